"""The embedded default tokenizer: a small byte-level BPE trained locally on a built-in corpus.

Digits are split before BPE, so every digit is always its own token (the tiny policy learns
arithmetic one digit at a time). Byte-level pre-tokenisation means any text encodes, with
no unknown token. The chat template is ChatML (``<|im_start|>role\\n…<|im_end|>\\n``).
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, IM_START, IM_END)
"""In id order: pad = 0, bos = 1, ``<|im_start|>`` = 2, ``<|im_end|>`` = 3 (also EOS)."""

CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou can call these functions, whose JSON signatures are inside <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments inside "
    '<tool_call></tool_call>:\\n<tool_call>\\n{"name": <function-name>, "arguments": <arguments-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML. Given ``tools``, a system turn lists them first (after the system message's own
text) and asks for calls in the Hermes format the gateway parses (``rollout.tool_calls``):
an assistant message's ``tool_calls`` (each ``{"function": {"name", "arguments"}}`` or just
``{"name", "arguments"}``) are written as ``<tool_call>`` blocks and ``tool``
messages as ``<tool_response>`` blocks of one user turn, as in the Qwen2.5 and Qwen3 templates."""

_WORDS = [
    "system",
    "user",
    "assistant",
    "tool",
    "observation",
    "answer",
    "question",
    "result",
    "error",
    "output",
    "input",
    "what",
    "is",
    "the",
    "number",
    "guess",
    "higher",
    "lower",
    "correct",
    "too",
    "high",
    "low",
    "try",
    "again",
    "you",
    "got",
    "it",
    "in",
    "turns",
    "compute",
    "add",
    "subtract",
    "multiply",
    "plus",
    "minus",
    "times",
    "equals",
    "sum",
    "difference",
    "product",
    "digits",
    "reply",
    "only",
    "python",
    "print",
    "def",
    "return",
    "for",
    "in",
    "range",
    "if",
    "else",
    "elif",
    "while",
    "import",
    "len",
    "list",
    "dict",
    "int",
    "str",
    "true",
    "false",
    "none",
    "and",
    "or",
    "not",
    "lambda",
    "class",
    "self",
    "assert",
    "try",
    "except",
    "raise",
    "with",
    "open",
    "as",
    "yield",
    "pass",
    "break",
    "shell",
    "ls",
    "cd",
    "cat",
    "echo",
    "grep",
    "wc",
    "head",
    "tail",
    "pwd",
    "mkdir",
    "rm",
    "cp",
    "mv",
    "find",
    "sort",
    "uniq",
    "file",
    "files",
    "directory",
    "exit",
    "code",
    "stdout",
    "stderr",
    "command",
    "run",
    "the",
    "a",
    "an",
    "of",
    "to",
    "is",
    "are",
    "was",
    "be",
    "this",
    "that",
    "it",
    "your",
    "my",
    "please",
    "hello",
    "done",
    "finished",
    "success",
    "failed",
    "task",
    "step",
    "action",
    "reward",
    "answer:",
    "guess:",
    "value",
    "total",
    "count",
]


def builtin_corpus(seed: int = 0, arithmetic_lines: int = 2000) -> list[str]:
    """Lines of text the tokenizer is trained on: arithmetic, environment words, code, chat.

    Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    lines = [
        " ".join(_WORDS),
        "0 1 2 3 4 5 6 7 8 9",
        "+ - * / = ( ) [ ] { } < > : ; , . ! ? ' \" # $ % & _ | ~ `",
    ]
    for _ in range(arithmetic_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? {a}{op}{b}={value}")
    for _ in range(arithmetic_lines // 4):
        secret, guess = rng.randint(1, 100), rng.randint(1, 100)
        verdict = "higher" if guess < secret else "lower" if guess > secret else "correct"
        lines.append(f"guess: {guess}\nToo {'low' if verdict == 'higher' else 'high'}, go {verdict}.")
    for _ in range(arithmetic_lines // 8):
        words = rng.sample(_WORDS, 6)
        lines.append(f"def {words[0]}({words[1]}):\n    return {words[1]} + {rng.randint(0, 9)}")
        lines.append(f"$ echo {words[2]} | wc -c\n{len(words[2]) + 1}")
        lines.append(f"{IM_START}user\n{' '.join(words)}{IM_END}\n{IM_START}assistant\n")
    return lines


def train_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on ``builtin_corpus(seed)``.

    Args:
        vocab_size: target size including the 256 byte tokens and the special tokens; the
            result can be smaller when the corpus has fewer merges to offer.
        seed: corpus seed.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be at least {minimum} (256 bytes + special tokens), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(builtin_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
