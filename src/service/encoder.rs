//! Requests into checked prompt ids: [`PromptCodec`] (a model's tokenizer and chat template,
//! usable before an engine opens) and [`Encoder`] (the codec with the engine's context bound and
//! the grammar engine of enforced output; `Send + Sync`, so a server validates a request on its
//! HTTP threads before it queues).
//!
//! Contract: an id past the vocabulary or a prompt past the context is an [`ApiError`] naming the
//! field; nothing here runs the model.

use super::answer::Tokens;
use crate::api::{ApiError, GenRequest, Kind, Prompt};
use crate::engine::Engine;
use crate::model::chat::{ChatError, ChatOptions, ChatTemplate, Thinking};
use crate::model::tokenizer::Tokenizer;
use std::sync::Arc;

/// Turns requests into checked prompt ids; shared (`Send + Sync`) so that a server can validate a
/// request on its HTTP threads before it queues.
pub struct Encoder {
    pub(super) engine: Arc<Engine>,
    pub(super) codec: PromptCodec,
    /// The grammar engine of enforced output (service/constrained.rs), built on first use.
    pub(super) grammars: std::sync::OnceLock<Result<crate::constrain::Grammars, String>>,
}

/// A model's tokenizer and chat template: a request's prompt into ids, without an engine (so a
/// batch can size its sequences' context from its requests before the engine opens).
pub struct PromptCodec {
    pub(super) tok: Option<Tokenizer>,
    chat: Option<ChatTemplate>,
    /// The thinking of a chat request that sets none: the model's generation_config.json
    /// (`chat_template_kwargs`), else the template's default (max).
    thinking: Thinking,
}

/// A request's prompt ids and how many tokens it may produce (it fits the context).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_new: usize,
}

/// The chat template of the model in `dir` can take tool definitions (it mentions `tools`).
pub fn template_takes_tools(dir: &std::path::Path) -> bool {
    std::fs::read_to_string(dir.join("chat_template.jinja")).is_ok_and(|s| s.contains("tools"))
}

impl PromptCodec {
    /// The tokenizer and chat template of the model in `dir` (none where it has none).
    pub fn load(dir: &std::path::Path) -> Result<Self, crate::engine::EngineError> {
        let tok = if dir.join("tiktoken.model").exists() { Some(crate::engine::load_tokenizer(dir)?) } else { None };
        let chat = tok.as_ref().and_then(|t| ChatTemplate::load(dir, t).ok());
        let g = crate::model::generation::GenerationDefaults::load(dir)?.unwrap_or_default();
        Ok(PromptCodec { tok, chat, thinking: g.thinking.unwrap_or(Thinking::Max) })
    }

    /// The thinking a chat request gets: its own, else the model's default.
    pub fn thinking(&self, req: &GenRequest) -> Thinking {
        req.thinking.unwrap_or(self.thinking)
    }

    /// The prompt's length in tokens, or past `most` the fewest tokens its size implies (found
    /// without tokenising it); None where it cannot be encoded (its error comes when the request
    /// is prepared).
    pub fn prompt_len(&self, req: &GenRequest, most: usize) -> Option<usize> {
        match self.encode_at_most(req, most) {
            Ok(ids) => Some(ids.ok()?.len()),
            Err(least) => Some(least),
        }
    }

    /// The prompt's token ids, where it encodes in at most `most` tokens.
    pub fn prompt_ids(&self, req: &GenRequest, most: usize) -> Option<Vec<u32>> {
        self.encode_at_most(req, most).ok()?.ok()
    }

    /// The prompt's token ids (unchecked against the vocabulary), unless its size alone shows it
    /// is more than `most` tokens: then the outer `Err` holds the fewest tokens it can be, found
    /// without tokenising it.
    fn encode_at_most(&self, req: &GenRequest, most: usize) -> Result<Result<Vec<u32>, ApiError>, usize> {
        let Some(tok) = self.tok.as_ref() else {
            return match &req.prompt {
                Prompt::Ids(ids) if ids.len() > most => Err(ids.len()),
                Prompt::Ids(ids) => Ok(Ok(ids.clone())),
                _ => Ok(Err(ApiError::invalid("prompt", "this model has no tokenizer: give token ids"))),
            };
        };
        let ids = match &req.prompt {
            Prompt::Ids(ids) if ids.len() > most => return Err(ids.len()),
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Text(t) => {
                let least = tok.min_tokens(t.len());
                if least > most {
                    return Err(least);
                }
                tok.encode(t)
            }
            Prompt::Messages(m) => {
                let Some(chat) = self.chat.as_ref() else {
                    return Ok(Err(ApiError::invalid("messages", "this model has no chat template")));
                };
                // The template renders every message's content: refused by their size before the
                // rendering copies them (a 50 MB message took the server's peak RSS to 315 MB).
                let content: usize =
                    m.as_array().map_or(0, |a| a.iter().filter_map(|x| x["content"].as_str()).map(str::len).sum());
                let least = tok.min_tokens(content);
                if least > most {
                    return Err(least);
                }
                let (tool_choice, response_format) = crate::api::template_vars(req);
                let opts = ChatOptions {
                    thinking: self.thinking(req),
                    add_generation_prompt: true,
                    tools: req.tools.clone(),
                    tool_choice,
                    response_format,
                };
                match chat.encode_at_most(tok, m, &opts, most) {
                    Ok(ids) => ids,
                    Err(ChatError::TooLong { at_least, .. }) => return Err(at_least),
                    Err(e) => return Ok(Err(ApiError::invalid("messages", e.to_string()))),
                }
            }
        };
        Ok(Ok(ids))
    }
}

impl Encoder {
    /// The model's tokenizer (None for a model given token ids only).
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.codec.tok.as_ref()
    }

    /// The chat template can take tool definitions.
    pub fn template_takes_tools(&self) -> bool {
        template_takes_tools(self.engine.dir())
    }

    /// The prompt's token ids.
    pub fn encode(&self, req: &GenRequest) -> Result<Vec<u32>, ApiError> {
        self.encode_at_most(req, usize::MAX).map_err(|least| {
            ApiError::invalid(self.prompt_param(req), format!("the prompt is at least {least} tokens"))
        })?
    }

    /// The thinking `req` runs with.
    pub fn thinking_of(&self, req: &GenRequest) -> Thinking {
        self.codec.thinking(req)
    }

    /// The request field that holds the prompt.
    fn prompt_param(&self, req: &GenRequest) -> &'static str {
        if req.kind == Kind::Chat { "messages" } else { "prompt" }
    }

    /// The prompt's checked token ids, unless its size alone shows it is more than `most` tokens:
    /// then the outer `Err` holds the fewest tokens it can be, found without tokenising it.
    fn encode_at_most(&self, req: &GenRequest, most: usize) -> Result<Result<Vec<u32>, ApiError>, usize> {
        Ok(self.codec.encode_at_most(req, most)?.and_then(|ids| self.checked_ids(req, ids)))
    }

    /// `ids` if they are a prompt: not empty, every id in the vocabulary.
    fn checked_ids(&self, req: &GenRequest, ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.engine.vocab()) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary ({})", self.engine.vocab()),
            ));
        }
        if ids.is_empty() {
            return Err(ApiError::invalid(self.prompt_param(req), "the prompt is empty"));
        }
        Ok(ids)
    }

    /// The printable text of one token (specials by name).
    pub fn token_text(&self, id: u32) -> String {
        match &self.codec.tok {
            Some(t) => t.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default(),
            None => id.to_string(),
        }
    }

    /// The prompt ids, checked against the context bound with the request's `max_tokens` (default:
    /// the rest of the context, at most `default_max_tokens`). A prompt whose size in bytes
    /// already implies too many tokens is refused with the same error before it is tokenised.
    pub fn prepare(&self, req: &GenRequest) -> Result<Prepared, ApiError> {
        let bound = self.engine.context_bound();
        // The longest prompt that leaves room for max_tokens new tokens (and at least one).
        let most = bound.saturating_sub(req.max_tokens.unwrap_or(0).max(1));
        self.check_constraint(req)?;
        let vocab = self.engine.vocab();
        if let Some(&(bad, _)) = req.sampling.logit_bias.iter().find(|&&(t, _)| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("'logit_bias': token id {bad} is outside the vocabulary ({vocab})"),
            ));
        }
        let prompt = match self.encode_at_most(req, most) {
            Ok(ids) => ids?,
            Err(least) => return Err(self.too_long(req, &format!("at least {least} tokens"), least, bound)),
        };
        let room = bound.saturating_sub(prompt.len());
        let max_new = req.max_tokens.unwrap_or(room.min(req.default_max_tokens.unwrap_or(usize::MAX)));
        if room == 0 || max_new > room {
            return Err(self.too_long(req, &format!("{} tokens", prompt.len()), prompt.len(), bound));
        }
        Ok(Prepared { prompt, max_new })
    }

    /// The context error: the prompt (`len` tokens, described as `what`) and the new tokens do
    /// not fit in `bound`.
    fn too_long(&self, req: &GenRequest, what: &str, len: usize, bound: usize) -> ApiError {
        let max_new = req.max_tokens.unwrap_or(bound.saturating_sub(len));
        let param = if req.max_tokens.is_some() { "max_tokens" } else { self.prompt_param(req) };
        ApiError::invalid(
            param,
            format!("the prompt ({what}) plus {max_new} new tokens exceeds the context of {bound} tokens"),
        )
        .with_code("context_length_exceeded")
    }
}

impl Tokens for Encoder {
    fn tokenizer(&self) -> Option<&Tokenizer> {
        self.codec.tok.as_ref()
    }

    fn thinking(&self, req: &GenRequest) -> Thinking {
        self.codec.thinking(req)
    }
}
