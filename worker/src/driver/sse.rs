//! Server-sent events for the streaming model drivers: a pure [`Decoder`] from bytes to
//! [`Event`]s with a cap on a line and on an event ([`Limits`]), and [`read`], which runs it
//! over a response body with an idle-read timeout.
//!
//! The framing is the WHATWG HTML standard's event-stream format (§9.2.6 "Interpreting an
//! event stream"): lines end with CRLF, LF or CR; a line starting with `:` is a comment;
//! `field: value` lines with one leading space stripped from the value; `data` lines of
//! one event are joined with `\n`; a blank line dispatches the event (none when it has no
//! `data`); a leading byte-order mark is skipped; an event not closed by a blank line when
//! the stream ends is dropped. `id` and `retry` are read and ignored (the drivers do not
//! reconnect).
//!
//! Limits (issue #28 item 7: a 40 MB line took `mur run` from about 20 MB to 144 MB RSS):
//! a line longer than [`Limits::line_bytes`], or an event whose data grows past
//! [`Limits::event_bytes`], is an error naming the limit, raised as soon as the limit is
//! passed (the decoder never holds more than the limit plus one network read).

use super::Error;
use futures::{Stream, StreamExt};
use std::fmt::Display;
use std::time::Duration;

/// Size caps of the decoder, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The longest line, terminator excluded. Default 8 MiB: one OpenAI chunk is one line,
    /// and a tool call writing a large file can send its whole arguments in one chunk.
    pub line_bytes: usize,
    /// The most data one event may carry (its `data` lines joined). Default 16 MiB.
    pub event_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { line_bytes: 8 << 20, event_bytes: 16 << 20 }
    }
}

/// One dispatched event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// The `event` field; empty when the event had none (the standard's `message`).
    pub event: String,
    /// The `data` lines joined with `\n`.
    pub data: String,
}

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A line ran past [`Limits::line_bytes`].
    #[error("an SSE line is longer than the {limit}-byte line limit")]
    LineTooLong {
        /// The limit, bytes.
        limit: usize,
    },
    /// An event's data ran past [`Limits::event_bytes`].
    #[error("an SSE event is larger than the {limit}-byte event limit")]
    EventTooLarge {
        /// The limit, bytes.
        limit: usize,
    },
    /// A line is not UTF-8 (the standard decodes lossily; a model reply that is not UTF-8
    /// is broken, so it is refused).
    #[error("an SSE line is not UTF-8")]
    NotUtf8,
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::NotUtf8 => Error::Protocol(e.to_string()),
            DecodeError::LineTooLong { .. } | DecodeError::EventTooLarge { .. } => Error::Limit(e.to_string()),
        }
    }
}

/// The UTF-8 byte-order mark.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The event-stream decoder: [`push`](Self::push) bytes as they come, in pieces of any
/// size (a piece may end inside a line, a CRLF or a multi-byte character), and take the
/// events that completed. Pure: no IO, no clock.
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    /// Bytes of the line being read, when it spans pieces (no terminator).
    buf: Vec<u8>,
    /// The previous piece ended with CR: a LF at the start of the next one belongs to it.
    after_cr: bool,
    /// Whether the head of the stream was checked for a byte-order mark.
    bom_checked: bool,
    event: String,
    data: String,
    has_data: bool,
}

impl Decoder {
    /// A decoder with `limits`.
    pub fn new(limits: Limits) -> Self {
        Decoder {
            limits,
            buf: Vec::new(),
            after_cr: false,
            bom_checked: false,
            event: String::new(),
            data: String::new(),
            has_data: false,
        }
    }

    /// Decodes `bytes`, appending every event they complete to `out`.
    ///
    /// # Errors
    /// [`DecodeError`] when a limit is passed or a line is not UTF-8; the decoder should
    /// then be dropped.
    pub fn push(&mut self, mut bytes: &[u8], out: &mut Vec<Event>) -> Result<(), DecodeError> {
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        if !self.bom_checked {
            // Hold the head back until it is known not to be (part of) a mark.
            self.buf.extend_from_slice(bytes);
            if self.buf.len() < BOM.len() && BOM.starts_with(&self.buf) {
                return Ok(());
            }
            self.bom_checked = true;
            let held = std::mem::take(&mut self.buf);
            return self.scan(held.strip_prefix(BOM).unwrap_or(&held), out);
        }
        self.scan(bytes, out)
    }

    /// Splits `bytes` into lines, the first one continuing what `buf` holds.
    fn scan(&mut self, mut bytes: &[u8], out: &mut Vec<Event>) -> Result<(), DecodeError> {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            let line_end = bytes[end];
            let rest = &bytes[end + 1..];
            if self.buf.is_empty() {
                self.check_line(end)?;
                self.line(&bytes[..end], out)?;
            } else {
                self.check_line(self.buf.len() + end)?;
                self.buf.extend_from_slice(&bytes[..end]);
                let mut line = std::mem::take(&mut self.buf);
                self.line(&line, out)?;
                line.clear();
                self.buf = line;
            }
            bytes = rest;
            if line_end == b'\r' {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        if !bytes.is_empty() {
            self.check_line(self.buf.len() + bytes.len())?;
            self.buf.extend_from_slice(bytes);
        }
        Ok(())
    }

    fn check_line(&self, len: usize) -> Result<(), DecodeError> {
        if len > self.limits.line_bytes {
            return Err(DecodeError::LineTooLong { limit: self.limits.line_bytes });
        }
        Ok(())
    }

    /// Interprets one line (terminator removed).
    fn line(&mut self, line: &[u8], out: &mut Vec<Event>) -> Result<(), DecodeError> {
        if line.is_empty() {
            if self.has_data {
                out.push(Event { event: std::mem::take(&mut self.event), data: std::mem::take(&mut self.data) });
            } else {
                self.event.clear();
            }
            self.has_data = false;
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                let value = std::str::from_utf8(value).map_err(|_| DecodeError::NotUtf8)?;
                let grown = self.data.len() + usize::from(self.has_data) + value.len();
                if grown > self.limits.event_bytes {
                    return Err(DecodeError::EventTooLarge { limit: self.limits.event_bytes });
                }
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            b"event" => {
                let value = std::str::from_utf8(value).map_err(|_| DecodeError::NotUtf8)?;
                value.clone_into(&mut self.event);
            }
            // id, retry, and unknown fields.
            _ => {}
        }
        Ok(())
    }
}

/// Whether [`read`] goes on after an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Read the next event.
    Continue,
    /// The reply is complete: stop reading (the rest of the body is not read).
    Stop,
}

/// Reads an event-stream body to its end (or until `on_event` says [`Flow::Stop`]), passing
/// each event to `on_event`. Each wait for the next piece of the body is bounded by `idle`.
///
/// # Errors
/// [`Error::Idle`] when `idle` passes without a byte, [`Error::Transport`] when the body
/// fails (a dropped connection), [`Error::Limit`] / [`Error::Protocol`] from the
/// [`Decoder`], and whatever `on_event` returns.
pub async fn read<S, B, E, F>(bytes: S, limits: Limits, idle: Duration, mut on_event: F) -> Result<(), Error>
where
    S: Stream<Item = Result<B, E>>,
    B: AsRef<[u8]>,
    E: Display,
    F: FnMut(Event) -> Result<Flow, Error>,
{
    let mut bytes = std::pin::pin!(bytes);
    let mut decoder = Decoder::new(limits);
    let mut events = Vec::new();
    loop {
        let piece = tokio::time::timeout(idle, bytes.next()).await.map_err(|_| Error::Idle(ceil_secs(idle)))?;
        let Some(piece) = piece else { return Ok(()) };
        let piece = piece.map_err(|e| Error::Transport(format!("the stream broke: {e}")))?;
        decoder.push(piece.as_ref(), &mut events)?;
        for event in events.drain(..) {
            if on_event(event)? == Flow::Stop {
                return Ok(());
            }
        }
    }
}

/// Whole seconds, rounded up so a sub-second timeout does not read "0 s".
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(pieces: &[&[u8]], limits: Limits) -> Result<Vec<Event>, DecodeError> {
        let mut d = Decoder::new(limits);
        let mut out = Vec::new();
        for p in pieces {
            d.push(p, &mut out)?;
        }
        Ok(out)
    }

    fn ev(event: &str, data: &str) -> Event {
        Event { event: event.into(), data: data.into() }
    }

    const BODY: &[u8] = b"\xEF\xBB\xBF: comment\r\nevent: a\r\ndata: one\r\ndata:two\r\n\r\ndata: h\xC3\xA9\rid: 7\r\rretry: 5\ndata\n\nevent: x\n\nbare\ndata: \xE2\x9C\x93\n\ndata: cut";

    #[test]
    fn events_are_the_same_however_the_bytes_are_split() {
        let want = vec![ev("a", "one\ntwo"), ev("", "hé"), ev("", ""), ev("", "✓")];
        assert_eq!(decode(&[BODY], Limits::default()).unwrap(), want);
        for i in 0..=BODY.len() {
            assert_eq!(decode(&[&BODY[..i], &BODY[i..]], Limits::default()).unwrap(), want, "split at {i}");
        }
        let bytewise: Vec<&[u8]> = BODY.chunks(1).collect();
        assert_eq!(decode(&bytewise, Limits::default()).unwrap(), want);
    }

    #[test]
    fn a_line_past_the_limit_is_an_error_naming_it_split_or_whole() {
        let limits = Limits { line_bytes: 16, event_bytes: 1024 };
        let ok = b"data: 0123456789\n\n"; // a 16-byte line
        assert_eq!(decode(&[ok], limits).unwrap(), vec![ev("", "0123456789")]);
        let long = b"data: 0123456789A\n\n";
        let err = DecodeError::LineTooLong { limit: 16 };
        assert_eq!(decode(&[long], limits), Err(err.clone()));
        assert_eq!(decode(&[&long[..10], &long[10..]], limits), Err(err.clone()));
        // Without a terminator yet: refused as soon as the held part passes the limit.
        assert_eq!(decode(&[b"data: 0123456789", b"ABCDEF"], limits), Err(err.clone()));
        assert_eq!(err.to_string(), "an SSE line is longer than the 16-byte line limit");
    }

    #[test]
    fn an_event_past_the_limit_is_an_error_naming_it() {
        let limits = Limits { line_bytes: 64, event_bytes: 10 };
        assert_eq!(decode(&[b"data: 01234\ndata: 5678\n\n"], limits).unwrap(), vec![ev("", "01234\n5678")]);
        let err = decode(&[b"data: 01234\ndata: 56789\n\n"], limits).unwrap_err();
        assert_eq!(err, DecodeError::EventTooLarge { limit: 10 });
        assert_eq!(err.to_string(), "an SSE event is larger than the 10-byte event limit");
        // Events are counted one at a time.
        assert_eq!(decode(&[b"data: 0123456789\n\ndata: 0123456789\n\n"], limits).unwrap().len(), 2);
    }

    #[test]
    fn a_line_that_is_not_utf8_is_an_error() {
        assert_eq!(decode(&[b"data: \xFF\n\n"], Limits::default()), Err(DecodeError::NotUtf8));
    }
}
