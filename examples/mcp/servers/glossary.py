#!/usr/bin/env python3
"""glossary: a small MCP server for the examples/mcp capsule, on stdio (Python 3 standard
library only, so the example runs with no network and nothing to install).

It speaks the Model Context Protocol's stdio transport: one JSON-RPC message per line on
stdin and stdout; anything on stderr is a log line (murmur keeps it in
logs/mcp-glossary.log). It answers initialize, ping, tools/list and tools/call, and
offers two tools:

- define {term}: the glossary's definition of a murmur term (an isError result when the
  glossary has no such term, which the model sees as a tool error);
- terms: every term the glossary knows, one per line.
"""

import json
import sys

GLOSSARY = {
    "capsule": "A folder with a murmur.yaml: one agent, its model, tools, hooks and limits.",
    "fleet": "A named group of capsules that work a queue of jobs together on the cluster.",
    "worker": "A process that runs capsules' sessions for the cluster, each in its own folder.",
    "coordinator": "The process that takes tasks, stores them in JetStream and hands them to workers.",
    "mcp": "The Model Context Protocol: capsules use MCP servers' tools, MCP clients drive murmur.",
}

TOOLS = [
    {
        "name": "define",
        "description": "The glossary's definition of a murmur term.",
        "inputSchema": {
            "type": "object",
            "properties": {"term": {"type": "string", "description": "the term, e.g. capsule"}},
            "required": ["term"],
        },
    },
    {
        "name": "terms",
        "description": "Every term the glossary knows.",
        "inputSchema": {"type": "object", "properties": {}},
    },
]


def text(t, is_error=False):
    return {"content": [{"type": "text", "text": t}], "isError": is_error}


def call(name, args):
    if name == "define":
        term = str(args.get("term", "")).strip().lower()
        if term in GLOSSARY:
            return text(f"{term}: {GLOSSARY[term]}")
        return text(f"no definition of {term!r}; known terms: {', '.join(sorted(GLOSSARY))}", True)
    if name == "terms":
        return text("\n".join(sorted(GLOSSARY)))
    return None


def answer(msg):
    method, params = msg.get("method"), msg.get("params") or {}
    if method == "initialize":
        return {
            # The client's version, which this small server accepts as it is.
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "glossary", "version": "1.0.0"},
        }
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        result = call(params.get("name"), params.get("arguments") or {})
        if result is None:
            raise LookupError(f"no tool {params.get('name')!r}")
        return result
    raise NotImplementedError(method)


def main():
    print("glossary: ready", file=sys.stderr, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if "id" not in msg:
            continue  # a notification (notifications/initialized, cancelled): nothing to answer
        try:
            reply = {"jsonrpc": "2.0", "id": msg["id"], "result": answer(msg)}
        except NotImplementedError as e:
            reply = {"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": f"no method {e}"}}
        except LookupError as e:
            reply = {"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32602, "message": str(e)}}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
