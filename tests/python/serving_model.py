"""A tiny random chat model with a word-level tokenizer made here (no downloads), saved as a
transformers model directory for the serving tests and benchmark."""

from __future__ import annotations

import torch

# Special tokens first, then plain words: every id decodes to a word, so any greedy answer of a
# random model is text that encodes back to the same ids.
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["user", "assistant", "system", ":"] + [f"w{i}" for i in range(88)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def save_tiny_chat_model(path, layers=2, hidden=64, heads=4, kv_heads=2, dtype=torch.float32):
    """Saves a random Llama-shaped model and its tokenizer to ``path``; returns the path."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
