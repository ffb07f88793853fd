//! The `openai` driver against the fake OpenAI server, over a real socket: what it sends,
//! and how it maps JSON and streamed replies, usage, finish reasons and HTTP errors.

use anyhow::Result;
use mur_proto::message::{Block, Message};
use mur_proto::trace::ProviderUsage;
use mur_tests::fake_openai::{FakeOpenAi, FakeReply};
use mur_worker::driver::openai::{Config, MaxTokensParam, OpenAi};
use mur_worker::driver::{Driver, Error, ModelRequest, ModelResponse, StopReason, ToolSpec};
use serde_json::{Value, json};

fn driver(fake: &FakeOpenAi, stream: bool) -> OpenAi {
    OpenAi::new(Config {
        endpoint: fake.url(),
        api_key: Some("sk-test".into()),
        stream,
        policy: Default::default(),
        max_tokens_param: MaxTokensParam::MaxTokens,
    })
}

fn sh_tool() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "sh".into(),
        description: "runs a shell command".into(),
        parameters: json!({"type": "object", "properties": {"command": {"type": "string"}}}),
    }]
}

async fn ask(driver: &OpenAi, messages: &[Message], tools: &[ToolSpec]) -> Result<ModelResponse, Error> {
    driver
        .call(&ModelRequest {
            model: "gpt-fake",
            system: "you are terse",
            messages,
            history_epoch: 0,
            tools,
            max_tokens: 64,
            task_text: "",
        })
        .await
}

fn completion(message: Value, finish_reason: Value, usage: Option<Value>) -> FakeReply {
    let mut body = json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    });
    if let Some(usage) = usage {
        body["usage"] = usage;
    }
    FakeReply::Json(body)
}

fn delta(delta: Value, finish_reason: Value) -> Value {
    json!({
        "id": "chatcmpl-2",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    })
}

fn call(id: &str, name: &str, input: Value) -> Block {
    Block::ToolCall { id: id.into(), name: name.into(), input }
}

#[tokio::test]
async fn non_streaming_text_reply_is_mapped_and_the_request_is_well_formed() -> Result<()> {
    let fake = FakeOpenAi::start(vec![FakeReply::text("hello there")]);
    // A trailing slash on the endpoint is tolerated.
    let driver = OpenAi::new(Config {
        endpoint: format!("{}/", fake.url()),
        api_key: Some("sk-test".into()),
        stream: false,
        policy: Default::default(),
        max_tokens_param: MaxTokensParam::MaxTokens,
    });
    let r = ask(&driver, &[Message::user("say hi")], &[]).await?;
    assert_eq!(r.content, vec![Block::Text { text: "hello there".into() }]);
    assert_eq!(r.stop, StopReason::EndTurn);

    let received = fake.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].authorization.as_deref(), Some("Bearer sk-test"));
    assert_eq!(
        received[0].body,
        json!({
            "model": "gpt-fake",
            "max_tokens": 64,
            "messages": [
                {"role": "system", "content": "you are terse"},
                {"role": "user", "content": "say hi"},
            ],
        })
    );
    Ok(())
}

#[tokio::test]
async fn no_authorization_header_without_an_api_key() -> Result<()> {
    let fake = FakeOpenAi::start(vec![FakeReply::text("ok")]);
    let driver = OpenAi::new(Config {
        endpoint: fake.url(),
        api_key: None,
        stream: false,
        policy: Default::default(),
        max_tokens_param: MaxTokensParam::MaxTokens,
    });
    ask(&driver, &[Message::user("x")], &[]).await?;
    assert_eq!(fake.received()[0].authorization, None);
    Ok(())
}

#[tokio::test]
async fn parallel_tool_calls_are_mapped_in_order() -> Result<()> {
    let fake = FakeOpenAi::start(vec![completion(
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "sh", "arguments": "{\"command\":\"ls\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "sh", "arguments": "{\"command\":\"pwd\"}"}},
        ]}),
        json!("tool_calls"),
        None,
    )]);
    let tools = sh_tool();
    let r = ask(&driver(&fake, false), &[Message::user("look")], &tools).await?;
    assert_eq!(
        r.content,
        vec![call("call_1", "sh", json!({"command": "ls"})), call("call_2", "sh", json!({"command": "pwd"})),]
    );
    assert_eq!(r.stop, StopReason::ToolCall);
    assert_eq!(
        fake.requests()[0]["tools"],
        json!([{"type": "function", "function": {
            "name": "sh",
            "description": "runs a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        }}])
    );
    Ok(())
}

#[tokio::test]
async fn tool_call_message_is_replayed_with_null_content() -> Result<()> {
    let fake = FakeOpenAi::start(vec![
        completion(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "sh", "arguments": "{\"command\":\"ls\"}"}},
            ]}),
            json!("tool_calls"),
            None,
        ),
        FakeReply::text("two files"),
    ]);
    let driver = driver(&fake, false);
    let tools = sh_tool();
    let mut messages = vec![Message::user("what is here?")];
    let first = ask(&driver, &messages, &tools).await?;
    messages.push(Message::assistant(first.content));
    messages.push(Message::tool_result("call_1", "a\nb", false));
    let second = ask(&driver, &messages, &tools).await?;
    assert_eq!(second.content, vec![Block::Text { text: "two files".into() }]);

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(
        requests[1]["messages"],
        json!([
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": "what is here?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "sh", "arguments": "{\"command\":\"ls\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a\nb"},
        ])
    );
    Ok(())
}

#[tokio::test]
async fn streamed_text_and_tool_calls_in_pieces_are_assembled() -> Result<()> {
    let fake = FakeOpenAi::start(vec![FakeReply::Stream(vec![
        delta(json!({"role": "assistant", "content": ""}), Value::Null),
        delta(json!({"content": "héllo "}), Value::Null),
        delta(json!({"content": "wörld ✓"}), Value::Null),
        delta(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "sh", "arguments": ""}}]}),
            Value::Null,
        ),
        delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"comm"}}]}), Value::Null),
        delta(
            json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                "function": {"name": "sh", "arguments": "{\"command\":"}}]}),
            Value::Null,
        ),
        delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "and\":\"echo ✓\"}"}}]}), Value::Null),
        delta(json!({"tool_calls": [{"index": 1, "function": {"arguments": "\"wörld\"}"}}]}), Value::Null),
        delta(json!({}), json!("tool_calls")),
        json!({"id": "chatcmpl-2", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 30, "completion_tokens": 12,
                         "prompt_tokens_details": {"cached_tokens": 8}}}),
    ])]);
    let tools = sh_tool();
    let r = ask(&driver(&fake, true), &[Message::user("go")], &tools).await?;
    assert_eq!(
        r.content,
        vec![
            Block::Text { text: "héllo wörld ✓".into() },
            call("call_1", "sh", json!({"command": "echo ✓"})),
            call("call_2", "sh", json!({"command": "wörld"})),
        ]
    );
    assert_eq!(r.stop, StopReason::ToolCall);
    assert_eq!(
        r.usage,
        ProviderUsage {
            input_tokens_actual: Some(30),
            output_tokens_actual: Some(12),
            cached_tokens: Some(8),
            cache_write_tokens: None,
        }
    );
    let sent = &fake.requests()[0];
    assert_eq!(sent["stream"], true);
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
    Ok(())
}

#[tokio::test]
async fn usage_is_reported_when_present_and_none_when_absent() -> Result<()> {
    let usage = json!({"prompt_tokens": 21, "completion_tokens": 4,
                       "prompt_tokens_details": {"cached_tokens": 0}});
    let fake = FakeOpenAi::start(vec![
        completion(json!({"content": "a"}), json!("stop"), Some(usage)),
        completion(json!({"content": "b"}), json!("stop"), None),
        FakeReply::Stream(vec![delta(json!({"content": "c"}), json!("stop"))]),
    ]);
    let plain = driver(&fake, false);
    let with = ask(&plain, &[Message::user("x")], &[]).await?;
    assert_eq!(
        with.usage,
        ProviderUsage {
            input_tokens_actual: Some(21),
            output_tokens_actual: Some(4),
            cached_tokens: Some(0),
            cache_write_tokens: None,
        }
    );
    let without = ask(&plain, &[Message::user("x")], &[]).await?;
    assert_eq!(without.usage, ProviderUsage::default());
    let streamed = ask(&driver(&fake, true), &[Message::user("x")], &[]).await?;
    assert_eq!(streamed.usage, ProviderUsage::default());
    assert_eq!(streamed.content, vec![Block::Text { text: "c".into() }]);
    Ok(())
}

#[tokio::test]
async fn finish_reason_maps_to_stop_reason() -> Result<()> {
    let tool_calls = json!([{"id": "call_1", "type": "function",
                             "function": {"name": "sh", "arguments": "{}"}}]);
    let cases = [
        (json!({"content": "done"}), json!("stop"), StopReason::EndTurn),
        (json!({"content": "cut"}), json!("length"), StopReason::MaxTokens),
        (json!({"content": null, "tool_calls": tool_calls}), json!("tool_calls"), StopReason::ToolCall),
        (json!({"content": ""}), json!("content_filter"), StopReason::Other("content_filter".into())),
        (json!({"content": "no reason"}), Value::Null, StopReason::EndTurn),
    ];
    let fake = FakeOpenAi::start(
        cases.iter().map(|(message, reason, _)| completion(message.clone(), reason.clone(), None)).collect(),
    );
    let driver = driver(&fake, false);
    for (message, reason, want) in cases {
        let r = ask(&driver, &[Message::user("x")], &[]).await?;
        assert_eq!(r.stop, want, "finish_reason {reason} with {message}");
    }
    Ok(())
}

#[tokio::test]
async fn http_401_is_a_status_error() -> Result<()> {
    let body = r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}"#;
    let fake = FakeOpenAi::start(vec![FakeReply::Status(401, body.into())]);
    let err = ask(&driver(&fake, true), &[Message::user("x")], &[]).await.unwrap_err();
    match err {
        Error::Status { status, body, .. } => {
            assert_eq!(status, 401);
            assert!(body.contains("Incorrect API key"), "{body}");
        }
        other => panic!("expected a status error, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn in_band_error_with_200_is_a_provider_error() -> Result<()> {
    let fake = FakeOpenAi::start(vec![
        FakeReply::Json(json!({"error": {"message": "the model is overloaded"}})),
        FakeReply::Stream(vec![
            delta(json!({"content": "par"}), Value::Null),
            json!({"error": {"message": "stream broke"}}),
        ]),
    ]);
    let err = ask(&driver(&fake, false), &[Message::user("x")], &[]).await.unwrap_err();
    assert_eq!(err.to_string(), "the provider reported an error: the model is overloaded");
    let err = ask(&driver(&fake, true), &[Message::user("x")], &[]).await.unwrap_err();
    assert_eq!(err.to_string(), "the provider reported an error: stream broke");
    Ok(())
}

#[tokio::test]
async fn fake_answers_500_when_replies_run_out() -> Result<()> {
    let fake = FakeOpenAi::start(vec![]);
    let err = ask(&driver(&fake, false), &[Message::user("x")], &[]).await.unwrap_err();
    assert!(matches!(&err, Error::Status { status: 500, body, .. } if body.contains("no reply left")), "{err}");
    Ok(())
}
