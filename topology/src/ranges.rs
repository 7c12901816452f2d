//! Compact lists of integers (`"0-11,20,30-33"`) for layers and experts in placement files.
//!
//! Why this exists: a Kimi K2 placement names 60 layers × 384 experts; written out one by one
//! it would be unreadable. Ranges keep order (the order of experts on a device is its slot
//! order, which phy2log-style exports rely on), so parsing and formatting are exact inverses on
//! any list.

use serde::Deserialize;
use serde::de::{self, Visitor};
use std::fmt;

/// One inclusive range `first..=last` as written in a file.
pub type Span = (u64, u64);

/// Parse `"0-11,20"` into its ranges, in the written order. Whitespace around items is ignored.
pub fn parse_ranges(text: &str) -> Result<Vec<Span>, String> {
    let mut out = Vec::new();
    if text.trim().is_empty() {
        return Err("empty list; write numbers or ranges like \"0-11,20\"".into());
    }
    for item in text.split(',') {
        let item = item.trim();
        let num = |s: &str| {
            s.trim().parse::<u64>().map_err(|_| {
                format!("\"{item}\" is not a number or a range like \"0-11\" (in \"{text}\")")
            })
        };
        match item.split_once('-') {
            None => {
                let n = num(item)?;
                out.push((n, n));
            }
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!(
                        "range \"{item}\" runs backwards; write it as \"{b}-{a}\""
                    ));
                }
                out.push((a, b));
            }
        }
    }
    Ok(out)
}

/// Format a list compactly, keeping its order: ascending runs of three or more become `a-b`.
pub fn format_list(values: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let mut j = i;
        while j + 1 < values.len() && values[j + 1] == values[j].wrapping_add(1) {
            j += 1;
        }
        if j >= i + 2 {
            parts.push(format!("{}-{}", values[i], values[j]));
        } else {
            for v in &values[i..=j] {
                parts.push(v.to_string());
            }
        }
        i = j + 1;
    }
    parts.join(",")
}

/// A list as written in a file: an integer, a range string, or an array of either.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RawList {
    /// One number.
    Int(i64),
    /// A range string (`"0-11,20"`, or a keyword such as `"all"` where the caller allows it).
    Text(String),
    /// An array mixing numbers and range strings.
    List(Vec<RawList>),
}

impl<'de> Deserialize<'de> for RawList {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number, a range string like \"0-11,20\", or an array of those")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawList, E> {
                Ok(RawList::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawList, E> {
                Ok(RawList::Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawList, E> {
                Ok(RawList::Text(v.to_owned()))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<RawList, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<RawList>()? {
                    if let RawList::List(_) = item {
                        return Err(de::Error::custom(
                            "nested arrays are not allowed; use one flat array",
                        ));
                    }
                    items.push(item);
                }
                Ok(RawList::List(items))
            }
        }
        d.deserialize_any(V)
    }
}

impl RawList {
    /// The ranges, in order, or [`ListSpec::Keyword`] when the whole value is `keyword`
    /// (e.g. `"all"`).
    pub(crate) fn spec(&self, keyword: Option<&str>) -> Result<ListSpec, String> {
        match self {
            RawList::Int(v) if *v < 0 => Err(format!("{v} is negative")),
            RawList::Int(v) => Ok(ListSpec::Ranges(vec![(*v as u64, *v as u64)])),
            RawList::Text(s) if Some(s.trim()) == keyword => Ok(ListSpec::Keyword),
            RawList::Text(s) => parse_ranges(s).map(ListSpec::Ranges).map_err(|e| {
                match keyword
                    .filter(|k| is_word(s) && crate::diag::nearest(s.trim(), [*k]).is_some())
                {
                    Some(k) => format!("\"{s}\" is not a list of numbers; did you mean \"{k}\"?"),
                    None => e,
                }
            }),
            RawList::List(items) => {
                let mut out = Vec::new();
                for item in items {
                    match item.spec(None)? {
                        ListSpec::Ranges(r) => out.extend(r),
                        ListSpec::Keyword => {
                            return Err("a keyword cannot appear inside an array".into());
                        }
                    }
                }
                if out.is_empty() {
                    return Err("empty array; list at least one number".into());
                }
                Ok(ListSpec::Ranges(out))
            }
        }
    }
}

/// Letters only (after trimming): a misspelled keyword rather than a broken range list.
fn is_word(s: &str) -> bool {
    let s = s.trim();
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphabetic())
}

/// A parsed list: explicit ranges, or the caller's keyword (`"all"`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ListSpec {
    /// The keyword the caller allowed.
    Keyword,
    /// Inclusive ranges in written order.
    Ranges(Vec<Span>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parse_examples() {
        assert_eq!(parse_ranges("0-11"), Ok(vec![(0, 11)]));
        assert_eq!(parse_ranges(" 5, 0-2 ,9"), Ok(vec![(5, 5), (0, 2), (9, 9)]));
        assert!(parse_ranges("3-1").unwrap_err().contains("backwards"));
        assert!(parse_ranges("a-b").unwrap_err().contains("not a number"));
        assert!(parse_ranges("").unwrap_err().contains("empty"));
        assert!(parse_ranges("1,,2").is_err());
    }

    #[test]
    fn format_examples() {
        assert_eq!(format_list(&[0, 1, 2, 3, 7, 5]), "0-3,7,5");
        assert_eq!(format_list(&[4, 5]), "4,5");
        assert_eq!(format_list(&[]), "");
    }

    proptest! {
        #[test]
        fn format_then_parse_is_identity(values in proptest::collection::vec(0u32..64, 1..40)) {
            let text = format_list(&values);
            let expanded: Vec<u32> = parse_ranges(&text)
                .unwrap()
                .into_iter()
                .flat_map(|(a, b)| (a as u32)..=(b as u32))
                .collect();
            prop_assert_eq!(expanded, values);
        }
    }
}
