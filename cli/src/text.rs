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
    if !text.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' if chars.peek() == Some(&'\n') => {}
            c if c.is_control() => out.extend(c.escape_debug()),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `text` on one line for a table cell: line breaks become spaces, the rest as
/// [`printable`], cut to `max` characters with `…` when longer.
pub fn cell(text: &str, max: usize) -> String {
    let flat = printable(text).replace(['\n', '\t'], " ");
    if flat.chars().count() > max {
        let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    } else {
        flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_line_breaks_and_tabs_kept() {
        assert_eq!(printable("\u{1b}[2J\u{1b}]0;owned\u{7}red\n\tok"), "\\u{1b}[2J\\u{1b}]0;owned\\u{7}red\n\tok");
        assert_eq!(printable("a\r\nb\rc"), "a\nb\\rc");
        assert!(matches!(printable("plain\ntext"), Cow::Borrowed(_)));
    }

    #[test]
    fn a_cell_is_one_escaped_line_cut_to_its_width() {
        assert_eq!(cell("one\ntwo\tthree", 50), "one two three");
        assert_eq!(cell("\u{1b}[31mred", 50), "\\u{1b}[31mred");
        assert_eq!(cell("abcdef", 4), "abc…");
        assert_eq!(cell("abcd", 4), "abcd");
    }
}
