//! The layout fingerprint of a key (the 12 hex digits after `@`): BLAKE2b with a 6-byte
//! digest over the facts the SGLang adapter gathers about a pool, written as Python's `repr`
//! of the tuple of those facts (issue 16). The adapter composed this in Python until now
//! (`hashlib.blake2b(repr(facts).encode(), digest_size=6)`); every key stored since then
//! carries that value, so this module reproduces those bytes exactly instead of choosing a
//! new encoding.
//!
//! Owns [`LayoutFact`] (the value types a fact can have), [`render`] (Python's `repr` of
//! them) and [`layout_fingerprint`].
//!
//! Invariants:
//! - For every fact this module renders itself (`None`, integers, ASCII text, tuples of
//!   those), the text is byte for byte what CPython's `repr` gives, so the fingerprint equals
//!   the one the Python adapter computed (tests/python/test_key_fingerprint.py checks it
//!   against `hashlib` over every pool kind the test harness builds).
//! - Text with a non-ASCII character is not rendered here: whether CPython escapes a character
//!   depends on the Unicode database of the running interpreter (`str.isprintable`), so such
//!   text, like any value of another type, arrives as [`LayoutFact::Rendered`] (the caller's
//!   `repr`). [`render`] refuses non-ASCII [`LayoutFact::Text`] with a typed error rather
//!   than guess.
//! - Nothing panics on any input; nesting is bounded ([`MAX_FACT_DEPTH`]).

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;

/// Digest size in bytes (12 hex digits in the key).
pub const FINGERPRINT_BYTES: usize = 6;

/// Deepest tuple nesting [`render`] accepts (the adapter's facts nest one level).
pub const MAX_FACT_DEPTH: usize = 16;

/// One fact about a pool's layout, typed as Python held it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutFact {
    /// Python `None`.
    None,
    /// A Python `int` (exactly `int`, not `bool`, whose `repr` is `True` / `False`).
    Int(i128),
    /// A Python `str` of ASCII characters only.
    Text(String),
    /// A Python `tuple` of facts.
    Tuple(Vec<LayoutFact>),
    /// A value already written as Python's `repr` gave it (non-ASCII text, `bool`, `float`,
    /// enums, integers beyond 128 bits, any other object), copied verbatim.
    Rendered(String),
}

/// Why a set of facts cannot be rendered exactly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    #[error(
        "fact text {0:?} has non-ASCII characters: pass Python's repr of it as a rendered fact"
    )]
    NonAsciiText(String),
    #[error("facts nest deeper than {MAX_FACT_DEPTH} tuples")]
    TooDeep,
}

/// Append Python's `repr` of `fact` to `out`.
pub fn render(fact: &LayoutFact, out: &mut String) -> Result<(), FingerprintError> {
    render_at(fact, out, 0)
}

fn render_at(fact: &LayoutFact, out: &mut String, depth: usize) -> Result<(), FingerprintError> {
    match fact {
        LayoutFact::None => out.push_str("None"),
        LayoutFact::Int(value) => out.push_str(&value.to_string()),
        LayoutFact::Text(text) => render_ascii_str(text, out)?,
        LayoutFact::Rendered(text) => out.push_str(text),
        LayoutFact::Tuple(items) => {
            if depth >= MAX_FACT_DEPTH {
                return Err(FingerprintError::TooDeep);
            }
            out.push('(');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render_at(item, out, depth + 1)?;
            }
            // A 1-tuple keeps its trailing comma: `(7,)`.
            if items.len() == 1 {
                out.push(',');
            }
            out.push(')');
        }
    }
    Ok(())
}

/// CPython's `unicode_repr` restricted to ASCII: single quotes unless the text holds a single
/// quote and no double quote; the chosen quote and the backslash escaped; `\t`, `\n`, `\r` by
/// name; other control characters and DEL as `\xhh` (lowercase hex).
fn render_ascii_str(text: &str, out: &mut String) -> Result<(), FingerprintError> {
    if !text.is_ascii() {
        return Err(FingerprintError::NonAsciiText(text.to_string()));
    }
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for ch in text.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if c < ' ' || c == '\x7f' => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
    Ok(())
}

/// The fingerprint of `facts`: BLAKE2b-48 of Python's `repr(tuple(facts))`, as 12 lowercase
/// hex digits.
pub fn layout_fingerprint(facts: &[LayoutFact]) -> Result<String, FingerprintError> {
    let mut material = String::new();
    render(&LayoutFact::Tuple(facts.to_vec()), &mut material)?;
    Ok(digest_hex(material.as_bytes()))
}

/// BLAKE2b with a [`FINGERPRINT_BYTES`] digest (the digest length is part of BLAKE2b's
/// parameter block, so this is not a truncated 64-byte digest), as lowercase hex.
fn digest_hex(material: &[u8]) -> String {
    let mut digest = [0u8; FINGERPRINT_BYTES];
    // A 6-byte output is within BLAKE2b's 1..=64 and the buffer has exactly that length, so
    // neither call can fail; fall back to an all-zero digest rather than panic regardless.
    if let Ok(mut hasher) = Blake2bVar::new(FINGERPRINT_BYTES) {
        hasher.update(material);
        let _ = hasher.finalize_variable(&mut digest);
    }
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayoutFact::{Int, None as PyNone, Rendered, Text, Tuple};

    fn text(s: &str) -> LayoutFact {
        Text(s.to_string())
    }

    fn repr(fact: &LayoutFact) -> String {
        let mut out = String::new();
        render(fact, &mut out).unwrap();
        out
    }

    /// Values computed with CPython 3.11:
    /// `hashlib.blake2b(repr(facts).encode(), digest_size=6).hexdigest()`.
    #[test]
    fn known_fingerprints() {
        assert_eq!(layout_fingerprint(&[]).unwrap(), "832d12420223");
        let mla = [
            Int(1),
            text("zero-copy"),
            text("deepseek-ai-DeepSeek-V3"),
            text("kv"),
            text("MLATokenToKVPoolHost"),
            PyNone,
            text("page_first"),
            text("torch.bfloat16"),
            Int(64),
            Tuple(vec![Int(1_171_456)]),
            Int(1),
            PyNone,
            Int(1),
        ];
        assert_eq!(layout_fingerprint(&mla).unwrap(), "768057a6de9f");
        let odd = [
            Int(1),
            text("flat-page"),
            text(""),
            text("it's"),
            text("a\"b"),
            text("both'\""),
            text("back\\slash"),
            text("\t\n\r\x00\x1f\x7f"),
            Int(-5),
            Tuple(vec![Int(7)]),
            Tuple(vec![]),
            Tuple(vec![Int(1), Tuple(vec![Int(2)])]),
            PyNone,
        ];
        assert_eq!(
            repr(&Tuple(odd.to_vec())),
            r#"(1, 'flat-page', '', "it's", 'a"b', 'both\'"', 'back\\slash', '\t\n\r\x00\x1f\x7f', -5, (7,), (), (1, (2,)), None)"#
        );
        assert_eq!(layout_fingerprint(&odd).unwrap(), "bd7fba99e661");
        // An integer beyond i128 arrives rendered.
        let big = [Rendered("12345678901234567890123".into())];
        assert_eq!(layout_fingerprint(&big).unwrap(), "ad3d9b4108bd");
    }

    #[test]
    fn refuses_what_it_cannot_render_exactly() {
        assert_eq!(
            layout_fingerprint(&[text("Mödel")]),
            Err(FingerprintError::NonAsciiText("Mödel".into()))
        );
        let mut deep = Int(0);
        for _ in 0..=MAX_FACT_DEPTH {
            deep = Tuple(vec![deep]);
        }
        assert_eq!(layout_fingerprint(&[deep]), Err(FingerprintError::TooDeep));
    }
}
