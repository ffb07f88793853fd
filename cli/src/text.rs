//! Texts that came from tasks, jobs, models and hooks, made safe to print on a terminal.
//!
//! A job's text, a model's answer or a hook's message may carry control characters (an
//! ANSI colour, a cursor move, a screen clear, a terminal title): printed raw, they act on
//! the terminal of whoever lists them. Human output escapes them as Rust writes them
//! (`\u{1b}`); `--json` output is JSON-escaped already and stays as it was stored.

use std::borrow::Cow;

/// `text` with every control character but a line break and a tab escaped (`\u{1b}[31m`
/// for an ESC), and a carriage return that ends a line dropped (CRLF texts print as
/// lines). Borrowed when there is nothing to escape.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(|c| escaped(c) && c != '\n' && c != '\t') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' if chars.peek() == Some(&'\n') => {}
            c if escaped(c) => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether `c` is written escaped: a control character, or a bidirectional override or
/// isolate (U+202A–U+202E, U+2066–U+2069), which reorders the text shown after it.
fn escaped(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// `text` on one line for a table cell: line breaks and tabs become spaces, the rest as
/// [`printable`], cut to `max` characters with `…` when longer (never inside an escape).
pub fn cell(text: &str, max: usize) -> String {
    let pieces: Vec<String> = text
        .chars()
        .filter(|c| *c != '\r')
        .map(|c| match c {
            '\n' | '\t' => " ".to_string(),
            c if escaped(c) => c.escape_unicode().to_string(),
            c => c.to_string(),
        })
        .collect();
    let width = |p: &String| p.chars().count();
    if pieces.iter().map(width).sum::<usize>() <= max {
        return pieces.concat();
    }
    let mut out = String::new();
    let mut used = 0;
    for p in &pieces {
        if used + width(p) > max.saturating_sub(1) {
            break;
        }
        used += width(p);
        out.push_str(p);
    }
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_line_breaks_and_tabs_kept() {
        assert_eq!(printable("\u{1b}[2J\u{1b}]0;owned\u{7}red\n\tok"), "\\u{1b}[2J\\u{1b}]0;owned\\u{7}red\n\tok");
        assert_eq!(printable("a\r\nb\rc"), "a\nb\\u{d}c");
        assert_eq!(printable("file\u{202E}txt.exe"), "file\\u{202e}txt.exe");
        assert!(matches!(printable("plain\ntext"), Cow::Borrowed(_)));
    }

    #[test]
    fn a_cell_is_one_escaped_line_cut_to_its_width() {
        assert_eq!(cell("one\ntwo\tthree", 50), "one two three");
        assert_eq!(cell("\u{1b}[31mred", 50), "\\u{1b}[31mred");
        assert_eq!(cell("abcdef", 4), "abc…");
        assert_eq!(cell("abcd", 4), "abcd");
        // An escape is kept whole or left out, never cut.
        assert_eq!(cell("ab\u{1b}[31m", 6), "ab…");
        assert_eq!(cell("ab\u{1b}[31m", 12), "ab\\u{1b}[31m");
    }
}
