#!/usr/bin/env python3
"""A command-line agent: any program that reads the row from stdin, talks to the model through the
endpoint in its environment, and prints its reward. asyncrl runs it once per episode
(`workflow: {kind: command, argv: [python, examples/command_agent/agent.py]}`).

It uses only the environment asyncrl sets: OPENAI_BASE_URL / OPENAI_API_KEY (or, with --anthropic,
ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY and the Messages API). It asks the question, checks the
reply against the row's answer and prints 1 or 0 as its last line.
"""

from __future__ import annotations

import json
import os
import sys


def ask(messages: list[dict], anthropic: bool, max_tokens: int) -> str:
    if anthropic:
        from anthropic import Anthropic

        client = Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"],
                           api_key=os.environ["ANTHROPIC_API_KEY"], max_retries=0)
        system = "\n".join(m["content"] for m in messages if m["role"] == "system")
        reply = client.messages.create(
            model="default", max_tokens=max_tokens, **({"system": system} if system else {}),
            messages=[m for m in messages if m["role"] != "system"])
        return "".join(b.text for b in reply.content if b.type == "text")
    from openai import OpenAI

    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"],
                    api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
    reply = client.chat.completions.create(model="default", messages=messages,
                                           max_tokens=max_tokens)
    return reply.choices[0].message.content or ""


def main() -> None:
    row = json.load(sys.stdin)
    anthropic = "--anthropic" in sys.argv
    text = ask(list(row["messages"]), anthropic, max_tokens=8)
    print(f"reply: {text!r}", file=sys.stderr)
    print(1.0 if text.strip() == str(row["answer"]).strip() else 0.0)


if __name__ == "__main__":
    main()
