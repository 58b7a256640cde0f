"""A small agent: asks the model over plain HTTP for shell commands, runs them, and repeats.

It talks to ``$OPENAI_BASE_URL/chat/completions`` with urllib (several turns, seeded per
turn) and uses a shell tool (``subprocess``) for every reply; the transcript goes to
``transcript.json`` and, as the last line, to stdout.
"""

import json
import os
import subprocess
import urllib.request

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
    tool = subprocess.run(
        ["bash", "-c", reply], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
    )
    messages.append({"role": "user", "content": tool.stdout + tool.stderr})
with open("transcript.json", "w") as handle:
    json.dump(messages, handle)
print(json.dumps(messages))
