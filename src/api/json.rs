//! A request body parsed within a bound: the JSON document is built value by value straight from
//! the bytes, counting every value and object key against a budget sized by what a request can
//! use, and the parse stops at the first value past it. So memory per request is the body plus at
//! most the budget's values, whatever the body holds: a body of millions of small values in an
//! unknown field used to build a tree of ~40 bytes per input byte (a 64 MiB body took the server
//! from 0.33 to 4.9 GB before its 400).
//!
//! Contract: [`parse`] returns the document serde_json would (same values, numbers, duplicate keys
//! resolved the same way, its nesting limit) or an [`ApiError`]: 400 `invalid_json` for bytes
//! that are not one JSON document, 400 `too_many_values` naming the top-level field being read
//! when the budget ran out. It knows no field names: which fields a request takes is `request`'s.

use super::ApiError;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::cell::{Cell, RefCell};
use std::fmt;

/// Values (each scalar, array, object and object key) a request of a model with a context of
/// `context` tokens may hold: a value that reaches the prompt costs at least a token of it (an id,
/// a message's role and markers, a tool schema's key or value), so four per token leaves room for
/// the options and structure beside the prompt, and a few thousand more for small contexts.
pub fn value_budget(context: usize) -> usize {
    context.saturating_mul(4).saturating_add(4096)
}

/// `body` as one JSON document of at most `budget` values (see the module contract).
pub fn parse(body: &[u8], budget: usize) -> Result<Value, ApiError> {
    let state = Budget { left: Cell::new(budget), field: RefCell::new(None), over: Cell::new(false) };
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = Seed { b: &state, top: true }.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    parsed.map_err(|e| {
        if state.over.get() {
            let field = state.field.borrow().clone();
            let within = field.as_deref().map(|f| format!(" (reading '{f}')")).unwrap_or_default();
            ApiError {
                param: field,
                ..ApiError::new(
                    400,
                    "invalid_request_error",
                    "too_many_values",
                    format!(
                        "The request holds more than {budget} JSON values{within}: more than a request \
                         to this server can use."
                    ),
                )
            }
        } else {
            ApiError::new(
                400,
                "invalid_request_error",
                "invalid_json",
                format!("We could not parse the JSON body of your request: {e}"),
            )
        }
    })
}

/// What is left of the budget, and the top-level field being read (for the error).
struct Budget {
    left: Cell<usize>,
    field: RefCell<Option<String>>,
    over: Cell<bool>,
}

impl Budget {
    /// Takes one value from the budget, or fails the parse.
    fn take<E: de::Error>(&self) -> Result<(), E> {
        match self.left.get().checked_sub(1) {
            Some(n) => {
                self.left.set(n);
                Ok(())
            }
            None => {
                self.over.set(true);
                Err(E::custom("too many values"))
            }
        }
    }
}

/// Builds one value (and all inside it) against the budget; `top`: the document itself, whose
/// keys are the request's fields.
#[derive(Clone, Copy)]
struct Seed<'b> {
    b: &'b Budget,
    top: bool,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.b.take()?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.b.take()?;
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.b.take()?;
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.b.take()?;
        // JSON has no NaN or infinity: serde_json's own Value makes a finite number here too.
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.b.take()?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.b.take()?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.b.take()?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.b.take()?;
        let mut v = Vec::new();
        while let Some(x) = seq.next_element_seed(Seed { b: self.b, top: false })? {
            v.push(x);
        }
        Ok(Value::Array(v))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.b.take()?;
        let mut m = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            self.b.take()?;
            if self.top {
                *self.b.field.borrow_mut() = Some(k.clone());
            }
            let v = map.next_value_seed(Seed { b: self.b, top: false })?;
            m.insert(k, v);
        }
        Ok(Value::Object(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_serde_json_parses() {
        let docs = [
            r#"{"model":"m","messages":[{"role":"user","content":"h\u00e9 \ud83d\ude00"}],"x":[1,-2,3.5,1e300,true,null,{}]}"#,
            r#"{"a":1,"a":2}"#,
            "[]",
            "  7 ",
            r#""s""#,
            r#"{"n":18446744073709551615,"m":-9223372036854775808,"f":0.1}"#,
        ];
        for d in docs {
            assert_eq!(parse(d.as_bytes(), 100).unwrap(), serde_json::from_str::<Value>(d).unwrap(), "{d}");
        }
        for bad in ["", "{", "[1,]", "{} {}", "nul", "\"\\ud800\"x"] {
            let e = parse(bad.as_bytes(), 100).unwrap_err();
            assert_eq!((e.status, e.code), (400, Some("invalid_json")), "{bad}: {e:?}");
        }
        // serde_json's nesting limit holds.
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(parse(deep.as_bytes(), 1000).unwrap_err().code, Some("invalid_json"));
    }

    #[test]
    fn the_budget_counts_values_and_keys_and_names_the_field() {
        // {"a":[1,2]}: the object, key a, the array, two numbers.
        assert!(parse(br#"{"a":[1,2]}"#, 5).is_ok());
        let e = parse(br#"{"a":[1,2]}"#, 4).unwrap_err();
        assert_eq!((e.status, e.code, e.param.as_deref()), (400, Some("too_many_values"), Some("a")), "{e:?}");
        // A huge field of small values stops at the budget, long before its end.
        let mut body = br#"{"model":"m","junk":["#.to_vec();
        body.extend(std::iter::repeat_n(&b"0,"[..], 1 << 20).flatten());
        body.extend(b"0]}");
        let e = parse(&body, 1000).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("junk"));
        assert!(e.message.contains("more than 1000 JSON values"), "{}", e.message);
        assert_eq!(value_budget(64), 4352);
        assert_eq!(value_budget(usize::MAX), usize::MAX);
    }
}
