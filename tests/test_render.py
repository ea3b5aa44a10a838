"""Chat rendering of observations (grpo/rollout/render.py) against chat templates written here, over a
character tokenizer built in code (no hub): a date-stamped template across midnight, a Qwen3-like
template that rewrites the earlier assistant turn (a ConfigError at setup), one that does so only for
some messages (the runtime ValueError), and ChatML, rendered exactly as the whole conversation is."""

from __future__ import annotations

import string
from datetime import datetime, timedelta

import pytest

from grpo.errors import ConfigError
from grpo.rollout import render as render_module
from grpo.rollout.render import ChatRender

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Llama 3.x's header: today's date through transformers' `strftime_now`, then the turns, no separator.
LLAMA = ("{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
         "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
         "{{- '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '<|eot_id|>' }}"
         "{%- for m in messages %}"
         "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
         "{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Qwen3's way: the last assistant turn with an empty think block, earlier ones without.
QWEN3 = ("{%- for m in messages %}"
         "{%- if m['role'] == 'assistant' and loop.last %}"
         "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
         "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
         "{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Rewrites the earlier turns only when the new message asks for it: appends for every other message.
CONTENT_DEPENDENT = ("{%- for m in messages %}"
                     "{%- if not (messages[-1]['content'] == 'forget' and m['role'] == 'assistant') %}"
                     "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                     "{%- endif %}{%- endfor %}"
                     "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer(template: str, eos: str = "<|im_end|>"):
    """One id per character (newlines included), one per special token; `template` as chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>"] + SPECIALS + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos,
                                  additional_special_tokens=[s for s in SPECIALS if s != eos])
    out.chat_template = template
    return out


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


class Midnight:
    """`datetime` whose now() moves one day on each call: every reading of the clock is another date."""

    calls = 0

    @classmethod
    def now(cls, tz=None):
        cls.calls += 1
        return datetime(2024, 7, 26, 23, 59, 59) + timedelta(days=cls.calls - 1)


def test_a_date_stamped_template_renders_across_midnight(monkeypatch):
    """Llama 3.x's template stamps today's date: ChatRender made on the 26th renders an observation on
    a later day exactly as the conversation's own template would (under the prompt's date), where
    rendering the base and the message at two instants gives two dates and no common prefix."""
    import transformers.utils.chat_template_utils as chat_template_utils

    tok = chat_tokenizer(LLAMA, eos="<|eot_id|>")
    monkeypatch.setattr(Midnight, "calls", 0)
    monkeypatch.setattr(chat_template_utils, "datetime", Midnight)  # transformers' `strftime_now`
    monkeypatch.setattr(render_module, "datetime", Midnight, raising=False)  # ChatRender's clock, one per render
    day = Midnight.now()  # the prompt's day: 26 Jul
    prompt = tok.apply_chat_template([{"role": "user", "content": "Guess 1-15:"}], tokenize=False,
                                     add_generation_prompt=True, strftime_now=day.strftime)
    assert "Today Date: 26 Jul 2024" in prompt

    render = ChatRender(tok)  # 27 Jul
    assert render.separator == []  # Llama writes nothing after <|eot_id|>
    # the precondition: two renderings at two instants disagree on the date, so base is no prefix
    base = tok.apply_chat_template(ChatRender.BASE, tokenize=False)
    full = tok.apply_chat_template(ChatRender.BASE + [{"role": "user", "content": "x"}], tokenize=False)
    assert "28 Jul" in base and "29 Jul" in full and not full.startswith(base)

    got = render("too low", after_eos=True)  # 30 Jul and later
    seq = ids(tok, prompt) + ids(tok, "8") + [tok.eos_token_id] + got
    conversation = [{"role": "user", "content": "Guess 1-15:"}, {"role": "assistant", "content": "8"},
                    {"role": "user", "content": "too low"}]
    whole = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, strftime_now=day.strftime)
    assert got == ids(tok, "<|start_header_id|>user<|end_header_id|>\n\ntoo low<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert seq == ids(tok, whole)
    assert render("too high", after_eos=False) == ids(tok, "<|start_header_id|>user<|end_header_id|>\n\ntoo high"
                                                           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_template_that_rewrites_earlier_turns_is_an_error_at_setup():
    """Qwen3's template drops the empty think block of an assistant turn that is no longer the last:
    the base is never a prefix, which ChatRender finds when it is made, not at the first observation."""
    tok = chat_tokenizer(QWEN3)
    with pytest.raises(ConfigError, match="rewrites earlier turns.*env.render=raw or a chat template that only appends"):
        ChatRender(tok)


def test_a_template_that_rewrites_earlier_turns_for_some_messages_fails_at_that_observation():
    """The runtime check stays, for what a probe at setup cannot see: a template that rewrites
    earlier turns only for some message texts. It is a ValueError, not a ConfigError."""
    tok = chat_tokenizer(CONTENT_DEPENDENT)
    render = ChatRender(tok)
    assert render("fine", after_eos=True) == ids(tok, "\n<|im_start|>user\nfine<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="rewrites earlier turns") as caught:
        render("forget", after_eos=True)
    assert not isinstance(caught.value, ConfigError)


@pytest.mark.parametrize("observation", ["too low", "x", "", "two\nlines", "  spaced  ", "<b>=</b>"])
def test_chatml_renders_exactly_as_the_whole_conversation(observation):
    """ChatML: the observation's ids are the newline after <|im_end|> (masked with the rest) when the
    turn ended on it, then the user message and the generation prompt, the template's own tokens."""
    tok = chat_tokenizer(CHATML)
    render = ChatRender(tok)
    assert render.separator == ids(tok, "\n")
    base = ids(tok, tok.apply_chat_template(ChatRender.BASE, tokenize=False))
    full = ids(tok, tok.apply_chat_template(ChatRender.BASE + [{"role": "user", "content": observation}],
                                            tokenize=False, add_generation_prompt=True))
    assert base[-2:] == [tok.eos_token_id] + render.separator
    suffix = ids(tok, f"<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n")
    assert render(observation, after_eos=True) == render.separator + suffix
    assert render(observation, after_eos=False) == suffix
    assert base[:-1] + render(observation, after_eos=True) == full  # sampled turn up to <|im_end|>, then the render


@pytest.mark.parametrize("template,eos", [(CHATML, "<|im_end|>"), (LLAMA, "<|eot_id|>")])
def test_the_render_self_check_passes_on_an_appending_template_and_fails_without_the_separator(template, eos, monkeypatch):
    """grpo.verify's render check: two turns and two observations joined as tokens decode to the
    template's rendering; with ChatML's separator dropped (the "\\n" after <|im_end|>) they do not."""
    render = ChatRender(chat_tokenizer(template, eos))
    ok, detail = render.check()
    assert ok, detail
    if template is CHATML:
        monkeypatch.setattr(render, "separator", [])
        ok, detail = render.check()
        assert not ok and "part at character" in detail, detail


def test_env_role_tool_renders_each_observation_as_a_tool_message():
    """env.role=tool: the observation is the template's tool message (ChatML: `<|im_start|>tool`), and
    the self-check joins and renders the same role."""
    tok = chat_tokenizer(CHATML)
    render = ChatRender(tok, role="tool")
    assert render("42", after_eos=False) == ids(tok, "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert render("42", after_eos=True) == ids(tok, "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    ok, detail = render.check()
    assert ok, detail
