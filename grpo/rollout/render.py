"""How an environment's observation text becomes tokens between two policy turns (`env.render`).

- raw: the text tokenized alone, no special tokens (the tiny model's character tokenizer, base models).
- chat: the observation as a user (or tool) message of the tokenizer's chat template, found as the
  suffix the message adds to a fixed base conversation, then the generation prompt. Where a sampled
  turn ended on the end-of-turn token and the template writes a separator after it (ChatML's "\\n"
  after <|im_end|>), the separator comes first, masked like the rest. A template whose rendering of
  base + message does not start with its rendering of base (one that rewrites earlier turns) is an
  error, not a silent fallback: the trainer must see what the sampler saw.
"""

from __future__ import annotations

from grpo.errors import ConfigError

CUT = " ... "  # marks where an over-long observation was cut


class RawRender:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.marker = self.encode(CUT)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def __call__(self, text: str, after_eos: bool) -> list[int]:
        return self.encode(text)


class ChatRender(RawRender):
    BASE = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]

    def __init__(self, tokenizer, role: str = "user"):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("env.render=chat needs a tokenizer with a chat template; this one has none: use env.render=raw.")
        self.role = role
        self.base = self.template(self.BASE, generation_prompt=False)
        eos = tokenizer.eos_token
        at = self.base.rfind(eos) if eos else -1
        if at < 0:
            raise ConfigError(f"env.render=chat: the chat template does not end an assistant turn with the tokenizer's "
                              f"end token {eos!r}, so turns cannot be joined exactly; use env.render=raw.")
        self.separator = self.encode(self.base[at + len(eos):])  # ChatML: "\n"

    def template(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def __call__(self, text: str, after_eos: bool) -> list[int]:
        full = self.template(self.BASE + [{"role": self.role, "content": text}], generation_prompt=True)
        if not full.startswith(self.base):
            raise ValueError(f"env.render=chat: the chat template renders the conversation differently once a "
                             f"{self.role} message follows (it rewrites earlier turns), so an observation cannot be "
                             f"appended as tokens; use env.render=raw or a template that only appends.")
        ids = self.encode(full[len(self.base):])
        return (self.separator if after_eos else []) + ids


RENDERERS = {"raw": RawRender, "chat": ChatRender}
