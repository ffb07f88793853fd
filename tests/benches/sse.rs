//! `cargo bench -p mur-tests --bench sse`: what the streamed-reply path of issue #28 costs —
//! the capped SSE decoder (`driver::sse`) and the shared tool-call assembler
//! (`driver::tool_calls`) — against what they replaced, in this one process so the figures
//! compare as ratios. Variants alternate round by round over the same bytes:
//!
//! - decode, old: `eventsource-stream` (the crate the drivers used before), events counted;
//! - decode, new: `sse::Decoder` with the default limits, events counted;
//! - reply, old: `eventsource-stream`, each chunk parsed with `serde_json`, and the old
//!   assembler (tool calls keyed by index, a copy of the code before issue #28, below);
//! - reply, new: `openai::read_stream` (decoder, chunk parse, `StreamAssembler` with the
//!   shared tool-call assembler).
//!
//! The body: a streamed completion of text deltas, then three tool calls whose arguments
//! (a 64 KiB file each) arrive in 2,000-byte fragments, cut into 1,400-byte network pieces.
//! Rounds: 200 in a release build, 5 in a debug build (CI's smoke run), or
//! `MUR_BENCH_ROUNDS=N`. Printed: the median time per round of each variant, MB/s, and the
//! ratio new/old.

use futures::StreamExt;
use mur_worker::driver::openai;
use mur_worker::driver::sse;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::{Duration, Instant};

fn chunk(delta: Value, finish: Value) -> String {
    let c = json!({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {c}\n\n")
}

fn body() -> Vec<u8> {
    let mut out = String::new();
    for i in 0..500 {
        out.push_str(&chunk(json!({"content": format!("word {i} ")}), Value::Null));
    }
    for call in 0..3u64 {
        let content = "é".repeat(10) + &"x".repeat(64 * 1024);
        let args = json!({"path": format!("f{call}.txt"), "content": content}).to_string();
        out.push_str(&chunk(
            json!({"tool_calls": [{"index": call, "id": format!("call_{call}"), "type": "function",
                                   "function": {"name": "write", "arguments": ""}}]}),
            Value::Null,
        ));
        let bytes = args.as_bytes();
        let mut at = 0;
        while at < bytes.len() {
            let mut end = (at + 2000).min(bytes.len());
            while !args.is_char_boundary(end) {
                end += 1;
            }
            out.push_str(&chunk(
                json!({"tool_calls": [{"index": call, "function": {"arguments": &args[at..end]}}]}),
                Value::Null,
            ));
            at = end;
        }
    }
    out.push_str(&chunk(json!({}), json!("tool_calls")));
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

fn pieces(body: &[u8]) -> Vec<Vec<u8>> {
    body.chunks(1400).map(<[u8]>::to_vec).collect()
}

fn stream(pieces: &[Vec<u8>]) -> impl futures::Stream<Item = Result<Vec<u8>, Infallible>> + '_ {
    futures::stream::iter(pieces.iter().cloned().map(Ok))
}

/// The assembler before issue #28, tool calls only (text and finish as now): calls keyed by
/// `index`, `id` and `name` overwritten, `arguments` appended.
#[derive(Default)]
struct OldAssembler {
    text: String,
    calls: BTreeMap<u64, (String, String, String)>,
    finish: Option<String>,
}

impl OldAssembler {
    fn feed(&mut self, chunk: &Value) {
        for choice in chunk.get("choices").and_then(Value::as_array).into_iter().flatten() {
            if let Some(delta) = choice.get("delta") {
                if let Some(t) = delta.get("content").and_then(Value::as_str) {
                    self.text.push_str(t);
                }
                for piece in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    let index = piece.get("index").and_then(Value::as_u64).unwrap_or(0);
                    let call = self.calls.entry(index).or_default();
                    if let Some(id) = piece.get("id").and_then(Value::as_str) {
                        call.0 = id.to_string();
                    }
                    let f = piece.get("function");
                    if let Some(n) = f.and_then(|f| f.get("name")).and_then(Value::as_str) {
                        call.1 = n.to_string();
                    }
                    if let Some(a) = f.and_then(|f| f.get("arguments")).and_then(Value::as_str) {
                        call.2.push_str(a);
                    }
                }
            }
            if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish = Some(r.to_string());
            }
        }
    }

    fn finish(self) -> usize {
        let inputs: Vec<Value> =
            self.calls.into_values().map(|(_, _, a)| serde_json::from_str(&a).unwrap_or(Value::Null)).collect();
        inputs.len() + usize::from(!self.text.is_empty())
    }
}

async fn decode_old(pieces: &[Vec<u8>]) -> usize {
    let mut events = std::pin::pin!(eventsource_stream::Eventsource::eventsource(stream(pieces)));
    let mut n = 0;
    while let Some(e) = events.next().await {
        n += usize::from(!e.unwrap().data.is_empty());
    }
    n
}

fn decode_new(pieces: &[Vec<u8>]) -> usize {
    let mut d = sse::Decoder::new(sse::Limits::default());
    let mut out = Vec::new();
    let mut n = 0;
    for p in pieces {
        d.push(p, &mut out).unwrap();
        n += out.len();
        out.clear();
    }
    n
}

async fn reply_old(pieces: &[Vec<u8>]) -> usize {
    let mut events = std::pin::pin!(eventsource_stream::Eventsource::eventsource(stream(pieces)));
    let mut asm = OldAssembler::default();
    while let Some(e) = events.next().await {
        let e = e.unwrap();
        if e.data == "[DONE]" {
            break;
        }
        asm.feed(&serde_json::from_str(&e.data).unwrap());
    }
    asm.finish()
}

async fn reply_new(pieces: &[Vec<u8>]) -> usize {
    let r = openai::read_stream(stream(pieces), sse::Limits::default(), Duration::from_secs(60)).await.unwrap();
    r.content.len()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    mur_nats::tls::install_crypto_provider();
    let rounds: usize = std::env::var("MUR_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) { 5 } else { 200 });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let body = body();
    let pieces = pieces(&body);
    // Both read the same events and build the same reply.
    assert_eq!(runtime.block_on(decode_old(&pieces)), decode_new(&pieces));
    assert_eq!(runtime.block_on(reply_old(&pieces)), runtime.block_on(reply_new(&pieces)));
    let mut times: [Vec<Duration>; 4] = Default::default();
    for _ in 0..rounds {
        let t = Instant::now();
        std::hint::black_box(runtime.block_on(decode_old(&pieces)));
        times[0].push(t.elapsed());
        let t = Instant::now();
        std::hint::black_box(decode_new(&pieces));
        times[1].push(t.elapsed());
        let t = Instant::now();
        std::hint::black_box(runtime.block_on(reply_old(&pieces)));
        times[2].push(t.elapsed());
        let t = Instant::now();
        std::hint::black_box(runtime.block_on(reply_new(&pieces)));
        times[3].push(t.elapsed());
    }
    let [mut a, mut b, mut c, mut d] = times;
    let (a, b, c, d) = (median(&mut a), median(&mut b), median(&mut c), median(&mut d));
    let mbs = |t: Duration| body.len() as f64 / t.as_secs_f64() / 1e6;
    println!(
        "sse bench: {} bytes in {} pieces, {} events, {rounds} rounds (median per round)",
        body.len(),
        pieces.len(),
        decode_new(&pieces)
    );
    println!("  decode  old (eventsource-stream)   {:>9.1} µs  {:>7.1} MB/s", a.as_secs_f64() * 1e6, mbs(a));
    println!("  decode  new (sse::Decoder)         {:>9.1} µs  {:>7.1} MB/s", b.as_secs_f64() * 1e6, mbs(b));
    println!("  decode  ratio new/old              {:.2}", b.as_secs_f64() / a.as_secs_f64());
    println!("  reply   old (+ old assembler)      {:>9.1} µs  {:>7.1} MB/s", c.as_secs_f64() * 1e6, mbs(c));
    println!("  reply   new (openai::read_stream)  {:>9.1} µs  {:>7.1} MB/s", d.as_secs_f64() * 1e6, mbs(d));
    println!("  reply   ratio new/old              {:.2}", d.as_secs_f64() / c.as_secs_f64());
}
