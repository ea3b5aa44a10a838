"""The tiny text policy: a 2-layer Qwen2 with a character-level tokenizer, built deterministically from
`model.tiny` (`model.path=tiny`), and the batches and greedy check its warm start
(grpo/tiny/warm_start.py) trains and measures it with. Imports nothing of grpo: a test, the doctor
or the bench builds it in a line."""

from __future__ import annotations

import string

import torch

TINY_CONTEXT = 256  # the tiny model's max_position_embeddings: prompt + completion tokens it can hold


def build_char_tokenizer():
    """Character-level tokenizer over printable ASCII; it prepends <bos> itself, as HF ones do."""
    # local: tokenizers and transformers are heavy; grpo.config imports this module (TINY_CONTEXT)
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(special + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def build_tiny_model(cfg, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM  # local: heavy (as above)

    torch.manual_seed(cfg.seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    return Qwen2ForCausalLM(config)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, samples, max_new_tokens: int, batch_size: int = 256) -> float:
    """Exact-match accuracy of greedy completions; used by the warm start."""
    model.eval()
    correct = 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        enc = tokenizer([s.prompt for s in chunk], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(t.strip() == s.answer for t, s in zip(texts, chunk))
    model.train()
    return correct / len(samples)


def supervised_batch(tokenizer, samples) -> dict:
    """input_ids, attention_mask and labels for prompt + answer + <eos>; the loss falls on the answer
    and <eos> only (right padding)."""
    prompt_lens = [len(tokenizer(s.prompt).input_ids) for s in samples]
    enc = tokenizer([s.prompt + s.answer for s in samples], return_tensors="pt", padding=True)
    rows = torch.arange(len(samples))
    ids = torch.cat([enc.input_ids, torch.full((len(samples), 1), tokenizer.pad_token_id)], dim=1)
    mask = torch.cat([enc.attention_mask, torch.zeros(len(samples), 1, dtype=torch.long)], dim=1)
    lengths = enc.attention_mask.sum(1)
    ids[rows, lengths] = tokenizer.eos_token_id
    mask[rows, lengths] = 1
    labels = ids.clone()
    labels[mask == 0] = -100
    for row, p in enumerate(prompt_lens):
        labels[row, :p] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def demonstration_batch(tokenizer, samples, demonstration) -> dict:
    """input_ids, attention_mask and labels for prompt + a demonstrated episode: each trained segment
    (a policy turn) is followed by <eos> and carries the loss, the others (observations) do not, as
    the episode driver masks them (right padding)."""
    rows, labels = [], []
    for s in samples:
        ids = list(tokenizer(s.prompt).input_ids)
        lab = [-100] * len(ids)
        for text, trained in demonstration(s):
            piece = list(tokenizer(text, add_special_tokens=False).input_ids) + ([tokenizer.eos_token_id] if trained else [])
            ids += piece
            lab += piece if trained else [-100] * len(piece)
        rows.append(ids)
        labels.append(lab)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])}
