"""How an environment's observation text becomes tokens between two policy turns (`env.render`).

- raw: the text tokenized alone, no special tokens (the tiny model's character tokenizer, base models).
- chat: the observation as a user (or tool) message of the tokenizer's chat template, found as the
  suffix the message adds to a fixed base conversation, then the generation prompt. The base and the
  base + message are rendered together for each observation, under one clock (`strftime_now` answers
  from one instant), so a date-stamped template (Llama 3.x's "Today Date: ...") renders the same
  header in both, whatever the date. Where a sampled turn ended on the end-of-turn token and the
  template writes a separator after it (ChatML's "\\n" after <|im_end|>), the separator comes first,
  masked like the rest. A template whose rendering of base + message does not start with its
  rendering of base (one that rewrites earlier turns, as Qwen3's drops the empty think block of an
  assistant turn that is no longer the last) is an error, not a silent fallback: the trainer must see
  what the sampler saw. It is found at setup by rendering a probe observation (a ConfigError); one
  that rewrites earlier turns only for some observation texts is a ValueError at that observation.
  An opening observation (`reset`'s text, before turn 1) is refused (a ConfigError): the prompt ends with
  the generation prompt, and a message after it renders no conversation the template would.
"""

from __future__ import annotations

from datetime import datetime

from grpo.errors import ConfigError

CUT = " ... "  # marks where an over-long observation was cut
PROBE = "observation"  # the observation ChatRender renders at setup to check the template only appends


class RawRender:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.marker = self.encode(CUT)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def __call__(self, text: str, after_eos: bool) -> list[int]:
        return self.encode(text)

    def opening(self, text: str, env_name: str) -> list[int]:
        """An observation `reset` returned, shown after the prompt before turn 1."""
        return self.encode(text)

    def fixed(self, after_eos: bool) -> tuple[int, int]:
        """(head, tail): how many leading and trailing ids of a rendered observation are the template's
        own (kept whole when an over-long observation is cut in the middle); none for raw text."""
        return 0, 0


class ChatRender(RawRender):
    BASE = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]

    def __init__(self, tokenizer, role: str = "user"):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("env.render=chat needs a tokenizer with a chat template; this one has none: use env.render=raw.")
        self.role = role
        base, full = self.render(PROBE)
        eos = tokenizer.eos_token
        at = base.rfind(eos) if eos else -1
        if at < 0:
            raise ConfigError(f"env.render=chat: the chat template does not end an assistant turn with the tokenizer's "
                              f"end token {eos!r}, so turns cannot be joined exactly; use env.render=raw.")
        self.separator = self.encode(base[at + len(eos):])  # ChatML: "\n"
        if not full.startswith(base):
            raise ConfigError(f"env.render=chat: the chat template renders the earlier turns differently once a "
                              f"{self.role} message follows (it rewrites earlier turns), so observations cannot be "
                              f"appended as tokens; use env.render=raw or a chat template that only appends.")
        self.wrapping: tuple[int, int] | None = None  # `fixed`'s, found on first use

    def template(self, messages: list[dict], generation_prompt: bool, strftime_now) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  strftime_now=strftime_now)

    def render(self, text: str) -> tuple[str, str]:
        """(base, base + a `role` message of `text` + the generation prompt), rendered under one clock:
        the template's `strftime_now` (transformers': `datetime.now().strftime`) answers from one
        instant for both, so a date stamp cannot differ between them."""
        now = datetime.now()
        base = self.template(self.BASE, False, now.strftime)
        full = self.template(self.BASE + [{"role": self.role, "content": text}], True, now.strftime)
        return base, full

    def check(self) -> tuple[bool, str]:
        """grpo.verify's render check: a prompt, two sampled turns (each ended by the end token) and two
        observations joined as the episode driver joins them, decoded, against the template's rendering
        of the same conversation -> (equal, what was compared)."""
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        now = datetime.now()
        convo = [{"role": "user", "content": "What is 2+3?"}]
        ids = self.encode(self.template(convo, True, now.strftime))
        for turn, obs in (("It is 6.", "No: try again."), ("It is 5.", "Correct.")):
            ids += self.encode(turn) + [eos] + self(obs, after_eos=True)
            convo += [{"role": "assistant", "content": turn}, {"role": self.role, "content": obs}]
        joined, whole = tok.decode(ids), self.template(convo, True, now.strftime)
        at = next((i for i, (a, b) in enumerate(zip(joined, whole)) if a != b), min(len(joined), len(whole)))
        ok = joined == whole
        return ok, (f"2 turns and 2 observations joined as tokens decode to the template's rendering ({len(ids)} tokens)"
                    if ok else f"joined tokens and the template's rendering part at character {at}: "
                               f"{joined[at:at + 40]!r} against {whole[at:at + 40]!r}")

    def opening(self, text: str, env_name: str) -> list[int]:
        """Refused: the prompt already ends with the template's generation prompt (an open assistant
        turn), so a user message after it is a conversation no chat template renders, and the policy
        would be sampled and trained on it."""
        raise ConfigError(f"env.render=chat: environment {env_name!r} opened the episode with an observation "
                          f"({text[:40]!r}...), but the prompt already ends with the chat template's generation prompt, "
                          f"so it cannot follow as a {self.role} message. Put the opening in the task's prompt (reset "
                          f"returning None), or use env.render=raw.")

    def fixed(self, after_eos: bool) -> tuple[int, int]:
        if self.wrapping is None:  # the message's header, and its end + the generation prompt: what two texts share
            one, two = self(PROBE, after_eos=False), self("a different text", after_eos=False)
            shortest = min(len(one), len(two))
            head = next((i for i, (a, b) in enumerate(zip(one, two)) if a != b), shortest)
            tail = next((i for i, (a, b) in enumerate(zip(one[::-1], two[::-1])) if a != b), shortest)
            self.wrapping = (head, min(tail, shortest - head))
        head, tail = self.wrapping
        return head + (len(self.separator) if after_eos else 0), tail

    def __call__(self, text: str, after_eos: bool) -> list[int]:
        base, full = self.render(text)
        if not full.startswith(base):  # the setup probe passed: this template depends on the message's content
            raise ValueError(f"env.render=chat: the chat template renders the earlier turns differently once this "
                             f"{self.role} message follows (it rewrites earlier turns depending on the message), so "
                             f"the observation cannot be appended as tokens; use env.render=raw or a chat template "
                             f"that only appends.")
        ids = self.encode(full[len(base):])
        return (self.separator if after_eos else []) + ids


RENDERERS = {"raw": RawRender, "chat": ChatRender}
