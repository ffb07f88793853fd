#!/usr/bin/env python3
"""tool-audit: a persistent murmur hook that keeps state across events (docs/hooks.md).

Declare it with no binding, so it receives every event but on-stage, and with
commit_policy: reopen-task, so its answer to on-task-end is honoured:

    hooks:
      - name: tool-audit
        commit_policy: reopen-task
        persistent: true
        command: [hooks/tool-audit.py]

With persistent: true the runtime starts this program once per session and writes one
event per line on stdin; the program must answer every line with exactly one line on
stdout. It counts the tool calls of each attempt of each task. When an attempt ends "ok"
without having called a single tool, it answers reopen-task, so the model is sent back to
check its answer with a tool. At the end of the session it writes tool-audit.json in the
workdir. Everything it prints on stderr goes to logs/hook-tool-audit.log.

Python 3 standard library only.
"""

import json
import os
import sys

PROTOCOL_VERSION = 1

# Per task id: tool calls in all attempts, calls per tool name, the attempts sent back.
tasks = {}
# Per task id: tool calls of the attempt under way.
attempt_calls = {}


def log(text):
    """One line in logs/hook-<name>.log (the runtime copies stderr there)."""
    print(text, file=sys.stderr, flush=True)


def task(task_id):
    return tasks.setdefault(task_id, {"calls": 0, "by_tool": {}, "reopened": []})


def handle(event):
    """Returns the answer to one event: a dict, or None for no answer."""
    kind = event["event"]
    if kind == "on-task-start":
        task(event["task_id"])
    elif kind == "on-tool-call":
        t = task(event["task_id"])
        attempt_calls[event["task_id"]] = attempt_calls.get(event["task_id"], 0) + 1
        t["calls"] += 1
        t["by_tool"][event["tool_name"]] = t["by_tool"].get(event["tool_name"], 0) + 1
    elif kind == "on-task-end":
        t = task(event["task_id"])
        calls = attempt_calls.pop(event["task_id"], 0)  # the next attempt starts from 0
        log(f"{event['task_id']} attempt {event['attempt']} ended {event['exit_status']} after {calls} tool call(s)")
        if event["exit_status"] == "ok" and calls == 0:
            t["reopened"].append(event["attempt"])
            return {
                "action": "reopen-task",
                "reason": "You answered without running any tool. Check the answer with a tool, then give it.",
            }
    elif kind == "on-session-end":
        path = os.path.join(os.environ.get("MURMUR_WORKDIR", "."), "tool-audit.json")
        report = {"session_id": event["session_id"], "exit_status": event["exit_status"], "tasks": tasks}
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        log(f"session {event['session_id']}: {event['total_tool_calls']} tool call(s); wrote {path}")
    return None


def main():
    log(f"started (pid {os.getpid()}) for session {os.environ.get('MURMUR_SESSION_ID')}")
    for line in sys.stdin:
        answer = None
        try:
            event = json.loads(line)
            if event.get("version") != PROTOCOL_VERSION:
                log(f"unknown protocol version {event.get('version')!r}; answering none")
            else:
                answer = handle(event)
        except Exception as e:  # keep answering: one line in, one line out
            log(f"cannot handle the event: {e!r}")
        # One line per event, even for no answer: an empty line means none.
        sys.stdout.write((json.dumps(answer) if answer else "") + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
