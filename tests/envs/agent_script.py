"""A small agent: asks the model over plain HTTP for shell commands, runs them, and repeats.

It talks to ``$OPENAI_BASE_URL/chat/completions`` with urllib (several turns, seeded per
turn) and uses a shell tool (``subprocess``) for every reply; the transcript goes to
``transcript.json`` and, as the last line, to stdout. A reply the tool cannot run (a NUL
byte, which no command line can hold; a tiny model samples one) or that runs past its time
comes back to the model as the tool's error, as an agent harness reports it.
"""

import json
import os
import subprocess
import urllib.request


def shell(command: str) -> str:
    if "\x00" in command:
        return "error: the command holds a NUL byte"
    try:
        tool = subprocess.run(
            ["bash", "-c", command], capture_output=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return "error: the command ran past 10 s"
    return (tool.stdout + tool.stderr).decode(errors="replace")


base = os.environ["OPENAI_BASE_URL"]
messages = [{"role": "user", "content": os.environ["TREADLE_TASK"]}]
for turn in range(3):
    request = urllib.request.Request(
        base + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "max_tokens": 16, "seed": turn}).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        },
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        reply = json.load(response)["choices"][0]["message"]["content"]
    messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": shell(reply)})
with open("transcript.json", "w") as handle:
    json.dump(messages, handle)
print(json.dumps(messages))
