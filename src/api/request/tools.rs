//! The tool and structured-output fields of a chat request: `tools`, `tool_choice`,
//! `parallel_tool_calls` and `response_format`, checked as OpenAI checks them.
//!
//! Contract: each tool is `{"type": "function", "function": {"name", "description"?,
//! "parameters"?, "strict"?}}` with a name of 1-64 of `a-zA-Z0-9_-` (OpenAI's rule) and, where
//! given, parameters that are a JSON object; names are unique. `tool_choice` is `auto`, `none`,
//! `required` or `{"type": "function", "function": {"name"}}` naming one of the tools (`required`
//! and a named function need tools). `response_format` is `{"type": "text"}`,
//! `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name", "schema"?,
//! "strict"?, "description"?}}`. Anything else is a 400 naming the field. Whether a schema can be
//! enforced is checked later, when the request is prepared (`constrain`).

use super::{ApiError, Fields, GenRequest, Owned, ParseContext, unsupported};
use serde_json::{Value, json};

/// `tool_choice`.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ToolChoice {
    /// The model decides (the default).
    #[default]
    Auto,
    /// No calls: the model is told not to call, and call syntax it still writes is content.
    None,
    /// At least one call, enforced.
    Required,
    /// One call of this function, enforced.
    Named(String),
}

/// `response_format`.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ResponseFormat {
    #[default]
    Text,
    /// Any JSON object, enforced.
    JsonObject,
    /// A JSON value of `schema`, enforced (strict or not).
    JsonSchema { name: String, schema: Value, strict: bool },
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The tools list, checked; returns it normalised (as given, each a `{"type", "function"}`).
fn tools(v: Value, name: &str) -> Result<Value, ApiError> {
    let Value::Array(list) = v else { return Err(ApiError::invalid(name, "'tools' must be a list")) };
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let at = format!("{name}[{i}]");
        let mut f = Fields::new(Owned(t), &format!("{at}."))?;
        match f.string("type")?.as_deref() {
            Some("function") => {}
            Some(o) => return Err(unsupported(&f.name("type"), &format!("tool type '{o}'"))),
            None => return Err(ApiError::invalid(f.name("type"), "each tool needs 'type': 'function'")),
        }
        let func =
            f.take("function").ok_or_else(|| ApiError::invalid(f.name("function"), "each tool needs a 'function'"))?;
        let mut ff = Fields::new(Owned(func), &format!("{at}.function."))?;
        let fname =
            ff.string("name")?.ok_or_else(|| ApiError::invalid(ff.name("name"), "each function needs a 'name'"))?;
        if !valid_name(&fname) {
            return Err(ApiError::invalid(
                ff.name("name"),
                format!("function name {fname:?} must be 1 to 64 letters, digits, underscores or dashes"),
            ));
        }
        if !seen.insert(fname.clone()) {
            return Err(ApiError::invalid(ff.name("name"), format!("two tools are named '{fname}'")));
        }
        let mut func = json!({"name": fname});
        if let Some(d) = ff.string("description")? {
            func["description"] = json!(d);
        }
        match ff.take("parameters") {
            None => {}
            Some(p @ Value::Object(_)) => func["parameters"] = p,
            Some(_) => {
                return Err(ApiError::invalid(ff.name("parameters"), "'parameters' must be a JSON schema object"));
            }
        }
        if let Some(s) = ff.bool("strict")? {
            func["strict"] = json!(s);
        }
        ff.finish()?;
        f.finish()?;
        out.push(json!({"type": "function", "function": func}));
    }
    Ok(Value::Array(out))
}

/// The tool and response-format fields of a chat request (or batch line) into `r`.
pub(super) fn fields(f: &mut Fields, ctx: &ParseContext, r: &mut GenRequest) -> Result<(), ApiError> {
    if let Some(t) = f.take("tools") {
        if !ctx.template_takes_tools {
            return Err(unsupported(&f.name("tools"), "tools (the model's chat template cannot take them)"));
        }
        let t = tools(t, &f.name("tools"))?;
        // An empty list is no tools (as OpenAI's clients send it).
        r.tools = t.as_array().is_some_and(|a| !a.is_empty()).then_some(t);
    }
    let name = f.name("tool_choice");
    r.tool_choice = match f.take("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            o => {
                return Err(ApiError::invalid(
                    name,
                    format!("unknown tool_choice '{o}' (auto, none, required, or a function)"),
                ));
            }
        },
        Some(v @ Value::Object(_)) => {
            let mut c = Fields::new(Owned(v), &format!("{name}."))?;
            match c.string("type")?.as_deref() {
                Some("function") => {}
                _ => return Err(ApiError::invalid(c.name("type"), "a named tool_choice has 'type': 'function'")),
            }
            let func = c
                .take("function")
                .ok_or_else(|| ApiError::invalid(c.name("function"), "give 'function': {'name': ...}"))?;
            let mut cf = Fields::new(Owned(func), &c.name("function."))?;
            let n =
                cf.string("name")?.ok_or_else(|| ApiError::invalid(cf.name("name"), "give the function's 'name'"))?;
            cf.finish()?;
            c.finish()?;
            ToolChoice::Named(n)
        }
        Some(_) => return Err(ApiError::invalid(name, "'tool_choice' must be a string or an object")),
    };
    let names: Vec<&str> = r
        .tools
        .iter()
        .flat_map(|t| t.as_array().into_iter().flatten())
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    match &r.tool_choice {
        ToolChoice::Required if names.is_empty() => {
            return Err(ApiError::invalid(name, "tool_choice 'required' needs 'tools'"));
        }
        ToolChoice::Named(n) if !names.contains(&n.as_str()) => {
            return Err(ApiError::invalid(
                format!("{name}.function.name"),
                format!("tool_choice names '{n}', which is not one of the tools ({})", names.join(", ")),
            ));
        }
        _ => {}
    }
    r.parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let rf = f.name("response_format");
    r.response_format = match f.take("response_format") {
        None => ResponseFormat::Text,
        Some(v) => {
            let mut o = Fields::new(Owned(v), &format!("{rf}."))?;
            let format = match o.string("type")?.as_deref() {
                Some("text") => ResponseFormat::Text,
                Some("json_object") => ResponseFormat::JsonObject,
                Some("json_schema") => {
                    let js = o.take("json_schema").ok_or_else(|| {
                        ApiError::invalid(
                            o.name("json_schema"),
                            "type 'json_schema' needs 'json_schema': {'name', 'schema'}",
                        )
                    })?;
                    let mut j = Fields::new(Owned(js), &o.name("json_schema."))?;
                    let n = j
                        .string("name")?
                        .ok_or_else(|| ApiError::invalid(j.name("name"), "the schema needs a 'name'"))?;
                    if !valid_name(&n) {
                        return Err(ApiError::invalid(
                            j.name("name"),
                            "the name must be 1 to 64 letters, digits, underscores or dashes",
                        ));
                    }
                    let _ = j.string("description")?;
                    let schema = match j.take("schema") {
                        None => json!({}),
                        Some(s @ (Value::Object(_) | Value::Bool(_))) => s,
                        Some(_) => {
                            return Err(ApiError::invalid(j.name("schema"), "'schema' must be a JSON schema object"));
                        }
                    };
                    let strict = j.bool("strict")?.unwrap_or(false);
                    j.finish()?;
                    ResponseFormat::JsonSchema { name: n, schema, strict }
                }
                Some(t) => return Err(unsupported(&o.name("type"), &format!("response_format type '{t}'"))),
                None => return Err(ApiError::invalid(o.name("type"), "response_format needs a 'type'")),
            };
            o.finish()?;
            format
        }
    };
    if r.response_format != ResponseFormat::Text && matches!(r.tool_choice, ToolChoice::Required | ToolChoice::Named(_))
    {
        return Err(ApiError::invalid(rf, "response_format and a required tool call cannot both be enforced"));
    }
    Ok(())
}

/// The template's `tool_choice` and `response_format` variables for `req`.
pub fn template_vars(req: &GenRequest) -> (Option<String>, Option<Value>) {
    let choice = match &req.tool_choice {
        _ if req.tools.is_none() => None,
        ToolChoice::Auto => None,
        ToolChoice::None => Some("none".to_string()),
        ToolChoice::Required | ToolChoice::Named(_) => Some("required".to_string()),
    };
    let format = match &req.response_format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(json!({"type": "json_object"})),
        ResponseFormat::JsonSchema { name, schema, strict } => {
            Some(json!({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}))
        }
    };
    (choice, format)
}
