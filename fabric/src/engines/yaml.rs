//! A small YAML writer for the Kubernetes manifests: JSON values in block style.
//!
//! Why this exists: the manifests are built as JSON values (what the Kubernetes API takes) and
//! written as the YAML people read and `kubectl apply` takes. Only what those need is here:
//! maps, lists, strings (double-quoted, JSON escapes, which YAML accepts; several lines as a
//! `|` block), numbers, booleans, null. Keys keep their insertion order.

use serde_json::Value;

/// The YAML documents `docs`, separated by `---`.
pub fn documents(docs: &[Value]) -> String {
    let mut out = String::new();
    for d in docs {
        out += "---\n";
        block(&mut out, d, 0);
    }
    out
}

/// `v` at `indent` as the body of a block (a map's entries or a list's items, one per line).
fn block(out: &mut String, v: &Value, indent: usize) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, item) in m {
                out.push_str(&pad);
                out.push_str(&scalar_string(k));
                out.push(':');
                value_after_key(out, item, indent);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for item in a {
                out.push_str(&pad);
                out.push('-');
                match item {
                    Value::Object(m) if !m.is_empty() => {
                        // The first entry on the dash's line, the rest aligned under it.
                        let mut first = true;
                        for (k, x) in m {
                            if first {
                                out.push(' ');
                                first = false;
                            } else {
                                out.push_str(&pad);
                                out.push_str("  ");
                            }
                            out.push_str(&scalar_string(k));
                            out.push(':');
                            value_after_key(out, x, indent + 2);
                        }
                    }
                    other => value_after_key(out, other, indent),
                }
            }
        }
        other => {
            out.push_str(&pad);
            out.push_str(&inline(other));
            out.push('\n');
        }
    }
}

/// What follows `key:` (or `-`) for `v`: an inline scalar, or a nested block.
fn value_after_key(out: &mut String, v: &Value, indent: usize) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            out.push('\n');
            block(out, v, indent + 2);
        }
        Value::Array(a) if !a.is_empty() => {
            out.push('\n');
            block(out, v, indent + 2);
        }
        Value::String(s) if s.contains('\n') && literal_ok(s) => {
            // A literal block: `|` keeps one final newline, `|-` none; `|+` keeps them all.
            let chomp = if !s.ends_with('\n') {
                "-"
            } else if s.ends_with("\n\n") {
                "+"
            } else {
                ""
            };
            out.push_str(&format!(" |2{chomp}\n"));
            let body = s.strip_suffix('\n').unwrap_or(s);
            for line in body.split('\n') {
                if !line.is_empty() {
                    out.push_str(&" ".repeat(indent + 2));
                    out.push_str(line);
                }
                out.push('\n');
            }
        }
        other => {
            out.push(' ');
            out.push_str(&inline(other));
            out.push('\n');
        }
    }
}

/// Whether `s` can be a literal block: printable, no tabs or carriage returns (kept as JSON
/// escapes otherwise), and its first line not indented.
fn literal_ok(s: &str) -> bool {
    !s.starts_with(' ')
        && s.chars()
            .all(|c| c == '\n' || (!c.is_control() && c != '\u{feff}'))
}

/// A scalar (or an empty map or list) on one line.
fn inline(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => scalar_string(s),
        Value::Array(_) => "[]".into(),
        Value::Object(_) => "{}".into(),
    }
}

/// A string as a double-quoted YAML scalar (JSON's escapes are YAML's).
fn scalar_string(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::documents;
    use serde_json::json;

    #[test]
    fn block_style_with_literal_strings() {
        let v = json!({
            "a": 1,
            "b": {"c": [1, "two", {"d": true, "e": null}], "f": []},
            "g": "line one\n  indented\n\nlast\n",
            "h": "no newline\nat end",
            "i": "tab\there",
        });
        let y = documents(&[v]);
        let want = "---\n\"a\": 1\n\"b\":\n  \"c\":\n    - 1\n    - \"two\"\n    - \"d\": true\n      \"e\": null\n  \"f\": []\n\"g\": |2\n  line one\n    indented\n\n  last\n\"h\": |2-\n  no newline\n  at end\n\"i\": \"tab\\there\"\n";
        assert_eq!(y, want);
    }
}
