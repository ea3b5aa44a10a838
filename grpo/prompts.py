"""The text a prompt is rendered to before tokenizing (leaf): through the tokenizer's chat template,
or plain; with a placeholder per image for a vision-language model (grpo/vision.py)."""

from __future__ import annotations

from grpo.errors import ConfigError


def format_prompt(tokenizer, prompt: str, chat_template: str = "auto", system_prompt: str | None = None,
                  images: int = 0, plain_image: str = "") -> tuple[str, bool]:
    """(the text the model continues, whether a chat template wrote it).

    With the tokenizer's chat template (`chat_template=auto` when the tokenizer has one, `always`),
    the prompt is a user message after an optional system message, then the template's generation
    prompt. Without one (`never`, or `auto` on a tokenizer that has none, like the tiny model's),
    the plain prompt, after the system prompt and a blank line. `images` > 0 puts that many images
    before the prompt's text: image content parts for the template (as Qwen2-VL's takes them), or
    `plain_image` (the model's unexpanded placeholder) once per image in plain text."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "always" and not has_template:
        raise ConfigError("task.chat_template=always but the tokenizer has no chat template; use task.chat_template=auto "
                          "or never.")
    if chat_template == "never" or not has_template:
        text = plain_image * images + prompt
        return (f"{system_prompt}\n\n{text}" if system_prompt else text), False
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    content = [{"type": "image"}] * images + [{"type": "text", "text": prompt}] if images else prompt
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
