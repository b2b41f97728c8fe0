"""A small tokenizer and text dataset in the layouts torchtitan's loaders read: a folder with
tokenizer.json and tokenizer_config.json, and a folder of JSON lines with a "text" field
(the layout of torchtitan's own c4_test)."""

import json
import os
import random


def make_assets(root: str) -> tuple[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer_dir, text_dir = os.path.join(root, "tokenizer"), os.path.join(root, "text")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(text_dir, exist_ok=True)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 200))) for _ in range(300)]
    with open(os.path.join(text_dir, "train.json"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return tokenizer_dir, text_dir
