"""Train the byte-level BPE tokenizer on the training split only.

    .venv/bin/python train_tokenizer.py --vocab 4096 --out tokenizer.json
"""
import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpus import load_split

EOS = "<|endoftext|>"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="tokenizer.json")
    args = ap.parse_args()
    files = load_split("train", packages=False)  # the first stage's corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in files), trainer=trainer)
    tok.save(args.out)
    print("vocab", tok.get_vocab_size(), "->", args.out)


if __name__ == "__main__":
    main()
