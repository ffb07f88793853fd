#!/bin/sh
# A stand-in agent program: reads the task on stdin, answers on stdout.
task=$(cat)
if [ "$1" = "--shout" ]; then
  printf 'TASK RECEIVED: %s\n' "$(printf '%s' "$task" | tr '[:lower:]' '[:upper:]')"
else
  printf 'task received: %s\n' "$task"
fi
