//! A JSON schema's cost bounded before the grammar engine sees it: a walk of the schema as the
//! engine would expand it, stopped at a budget, so that a small schema that expands
//! exponentially (nested `allOf` over `$ref`s to the level below) is refused in milliseconds
//! instead of costing the server seconds and gigabytes.
//!
//! Contract: [`check`] visits every subschema, following local `$ref`s (`#`, `#/...` JSON
//! pointers). A `$ref` reached again outside `allOf` costs one visit (the engine compiles it once
//! as a rule); inside `allOf` every visit is expanded (the engine intersects the schemas). Past
//! [`MAX_NODES`] visits the schema is refused. A `$ref` that reaches itself again with no value
//! in between (no property, item or other nested value) and no alternative (`anyOf`, `oneOf`) on
//! the way cannot match any finite JSON and is refused; so are `minLength`, `minItems`,
//! `minProperties` and `minContains` past [`MAX_MIN`], which no answer can reach. Remote `$ref`s
//! are left to the engine (which refuses them).

use super::ConstrainError;
use serde_json::Value;
use std::collections::HashSet;

/// Subschema visits a schema may cost, `$ref`s expanded as the engine expands them.
pub const MAX_NODES: usize = 50_000;
/// The largest `minLength`, `minItems`, `minProperties` or `minContains` taken.
pub const MAX_MIN: u64 = 100_000;

/// Keywords whose subschemas describe a nested value (a property, an item): a `$ref` that
/// reaches itself through one of them describes a finite tree.
const NESTED: &[&str] = &[
    "properties",
    "patternProperties",
    "additionalProperties",
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "propertyNames",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
];
/// Keywords whose subschemas describe the same value.
const SAME: &[&str] = &["not", "if", "then", "else"];
const MINS: &[&str] = &["minLength", "minItems", "minProperties", "minContains"];

struct Walk<'a> {
    root: &'a Value,
    what: &'static str,
    left: usize,
    /// `$ref`s being expanded, with the nesting and alternative counts when they were entered.
    open: Vec<(String, usize, usize)>,
    nested: usize,
    alternatives: usize,
    all_of: usize,
    /// `$ref`s compiled once already (outside `allOf`).
    done: HashSet<String>,
}

/// Checks `schema` (see the module contract); `what` names it in the error.
pub fn check(schema: &Value, what: &'static str) -> Result<(), ConstrainError> {
    let mut w = Walk {
        root: schema,
        what,
        left: MAX_NODES,
        open: Vec::new(),
        nested: 0,
        alternatives: 0,
        all_of: 0,
        done: HashSet::new(),
    };
    w.visit(schema)
}

impl Walk<'_> {
    fn refuse(&self, msg: String) -> ConstrainError {
        ConstrainError::Compile { what: self.what, msg }
    }

    fn visit(&mut self, v: &Value) -> Result<(), ConstrainError> {
        self.left = self.left.checked_sub(1).ok_or_else(|| {
            self.refuse(format!(
                "the schema expands past {MAX_NODES} subschemas ($ref and allOf expanded): too complex to enforce"
            ))
        })?;
        let Value::Object(m) = v else { return Ok(()) };
        for k in MINS {
            if let Some(n) = m.get(*k).and_then(Value::as_u64)
                && n > MAX_MIN
            {
                return Err(self.refuse(format!("{k} {n} is more than any answer can hold (at most {MAX_MIN})")));
            }
        }
        if let Some(r) = m.get("$ref").and_then(Value::as_str) {
            self.reference(r)?;
        }
        for (k, sub) in m {
            match k.as_str() {
                "allOf" => {
                    self.all_of += 1;
                    let r = self.each(sub);
                    self.all_of -= 1;
                    r?;
                }
                "anyOf" | "oneOf" => {
                    self.alternatives += 1;
                    let r = self.each(sub);
                    self.alternatives -= 1;
                    r?;
                }
                k if SAME.contains(&k) => self.visit(sub)?,
                k if NESTED.contains(&k) => {
                    self.nested += 1;
                    let r = match (k, sub) {
                        // Maps of subschemas.
                        ("properties" | "patternProperties" | "dependentSchemas", Value::Object(props)) => {
                            props.values().try_for_each(|s| self.visit(s))
                        }
                        (_, Value::Array(_)) => self.each(sub),
                        _ => self.visit(sub),
                    };
                    self.nested -= 1;
                    r?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn each(&mut self, v: &Value) -> Result<(), ConstrainError> {
        match v {
            Value::Array(a) => a.iter().try_for_each(|s| self.visit(s)),
            s => self.visit(s),
        }
    }

    fn reference(&mut self, r: &str) -> Result<(), ConstrainError> {
        let Some(pointer) = r.strip_prefix('#') else { return Ok(()) };
        if let Some(&(_, nested, alternatives)) = self.open.iter().find(|(o, _, _)| o == r) {
            if nested == self.nested && alternatives == self.alternatives {
                return Err(self.refuse(format!(
                    "$ref {r:?} refers back to itself with no value in between: no finite JSON matches it"
                )));
            }
            // Recursion through a nested value or an alternative: a finite tree, one rule.
            return Ok(());
        }
        if self.all_of == 0 && self.done.contains(r) {
            return Ok(());
        }
        let root = self.root;
        let Some(target) = root.pointer(pointer) else {
            return Err(self.refuse(format!("$ref {r:?} points to nothing in the schema")));
        };
        self.open.push((r.to_string(), self.nested, self.alternatives));
        let res = self.visit(target);
        self.open.pop();
        res?;
        if self.all_of == 0 {
            self.done.insert(r.to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `levels` of allOf over two refs to the level below, ending in a string pattern.
    fn bomb(levels: usize) -> Value {
        let mut defs = serde_json::Map::new();
        defs.insert("l0".into(), json!({"type": "string", "pattern": "^[a-z]+$"}));
        for i in 1..=levels {
            let below = format!("#/$defs/l{}", i - 1);
            defs.insert(format!("l{i}"), json!({"allOf": [{"$ref": below}, {"$ref": below}]}));
        }
        json!({"$defs": defs, "$ref": format!("#/$defs/l{levels}")})
    }

    #[test]
    fn an_exponential_schema_is_refused_at_once() {
        let t = std::time::Instant::now();
        let e = check(&bomb(24), "response_format").unwrap_err().to_string();
        assert!(e.contains("expands past"), "{e}");
        assert!(t.elapsed().as_millis() < 500, "{:?}", t.elapsed());
        // A few levels are fine.
        check(&bomb(4), "response_format").unwrap();
    }

    #[test]
    fn a_ref_that_only_reaches_itself_is_refused_and_a_recursive_tree_is_not() {
        for s in [
            json!({"$ref": "#"}),
            json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}),
        ] {
            let e = check(&s, "response_format").unwrap_err().to_string();
            assert!(e.contains("refers back to itself"), "{e}");
        }
        let tree = json!({"type": "object", "properties": {"name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}}}});
        check(&tree, "response_format").unwrap();
        let list = json!({"$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"});
        check(&list, "response_format").unwrap();
        let dangling = json!({"$ref": "#/$defs/missing"});
        assert!(check(&dangling, "response_format").unwrap_err().to_string().contains("points to nothing"));
    }

    #[test]
    fn minimums_no_answer_can_reach_are_refused() {
        for k in MINS {
            let e = check(&json!({ *k: 1_000_000_000u64 }), "response_format").unwrap_err().to_string();
            assert!(e.contains(k), "{e}");
        }
        check(&json!({"type": "string", "minLength": 10}), "response_format").unwrap();
    }

    #[test]
    fn a_shared_definition_is_counted_once_outside_all_of() {
        // 200 properties each naming a 400-node definition: 80,000 if expanded, ~600 as rules.
        let mut big = serde_json::Map::new();
        for i in 0..400 {
            big.insert(format!("f{i}"), json!({"type": "integer"}));
        }
        let mut props = serde_json::Map::new();
        for i in 0..200 {
            props.insert(format!("p{i}"), json!({"$ref": "#/$defs/addr"}));
        }
        let s =
            json!({"$defs": {"addr": {"type": "object", "properties": big}}, "type": "object", "properties": props});
        check(&s, "response_format").unwrap();
    }
}
