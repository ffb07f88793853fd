//! A fake OpenAI chat-completions server (issue #2).
