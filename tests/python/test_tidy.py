"""The tidy check (issue 28 §3): long functions, `unsafe` outside the listed modules and
`.expect(` in production Rust code fail against an allow-list that may only shrink; and the
checker itself sees what it claims to (planted violations in a scratch tree)."""

from pathlib import Path

from kvtier_dev import tidy


def test_the_tree_is_tidy_against_its_allow_list():
    problems = tidy.violations(tidy.scan(), tidy.load_allow())
    assert not problems, "\n".join(problems)


def _tree(tmp_path: Path, source: str) -> Path:
    src = tmp_path / "crates" / "demo" / "src"
    src.mkdir(parents=True)
    (src / "lib.rs").write_text(source)
    return tmp_path


def test_planted_violations_are_found_and_tests_literals_and_comments_are_not(tmp_path):
    long_body = "\n".join(f"    let x{i} = {i};" for i in range(80))
    source = f"""
//! fn fake_in_a_doc() {{ unsafe {{ }} }}
pub fn long_one() {{
{long_body}
}}

pub fn short_one() -> Result<(), String> {{
    let s = "fn not_a_function() {{ unsafe }}";
    let c = '{{';
    let r = r#"}} .expect("no") }}"#;
    let _ = (s, c, r);
    Ok(())
}}

pub fn risky(v: Option<u8>) -> u8 {{
    v.expect("planted")
}}

pub fn raw(p: *const u8) -> u8 {{
    // SAFETY: planted.
    unsafe {{ *p }}
}}

trait Declared {{
    fn only_declared(&self) -> u8;
}}

#[cfg(test)]
mod tests {{
    #[test]
    fn long_test() {{
{long_body}
        Some(1).expect("tests may");
        unsafe {{}}
    }}
}}
"""
    root = _tree(tmp_path, source)
    found = tidy.scan(root)
    assert found.long_functions == {"crates/demo/src/lib.rs::long_one": 82}
    assert found.unsafe_modules == {"crates/demo/src/lib.rs"}
    assert found.expect_calls == {"crates/demo/src/lib.rs": 1}
    problems = tidy.violations(found, {})
    assert len(problems) == 3, problems
    assert any("long_one is 82 lines" in p for p in problems)
    # Allow-listed exactly: clean. An entry beyond what is found must be removed (the list
    # only shrinks).
    allow = {
        "long_functions": {"crates/demo/src/lib.rs::long_one": 82},
        "unsafe_modules": ["crates/demo/src/lib.rs"],
        "expect_calls": {"crates/demo/src/lib.rs": 1},
    }
    assert tidy.violations(found, allow) == []
    allow["long_functions"]["crates/demo/src/lib.rs::gone"] = 90
    allow["expect_calls"]["crates/demo/src/lib.rs"] = 2
    stale = tidy.violations(found, allow)
    assert any("gone is allow-listed" in p for p in stale), stale
    assert any("lower its entry" in p for p in stale), stale
    # A listed function that grew fails.
    allow = {**allow, "long_functions": {"crates/demo/src/lib.rs::long_one": 75}}
    assert any("grew to 82" in p for p in tidy.violations(found, allow))
