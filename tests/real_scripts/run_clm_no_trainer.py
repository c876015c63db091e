"""Causal language modelling without the Trainer, in the shape of Hugging Face's
examples/pytorch/language-modeling/run_clm_no_trainer.py (accelerate).

Kept from that script's shape: ``parse_args()`` with its options (``--model_type``,
``--per_device_train_batch_size``, ``--per_device_eval_batch_size``, ``--learning_rate``,
``--weight_decay``, ``--num_train_epochs``, ``--max_train_steps``, ``--gradient_accumulation_steps``,
``--lr_scheduler_type``, ``--num_warmup_steps``, ``--output_dir``, ``--seed``, ``--block_size``,
``--use_slow_tokenizer``), ``main()`` with an ``Accelerator``, the raw texts tokenized and grouped
into ``block_size`` chunks with ``labels``, a shuffled train ``DataLoader`` and an eval one,
AdamW over two parameter groups (no decay for biases and LayerNorm weights), ``get_scheduler``,
``accelerator.prepare``, a ``tqdm`` progress bar, gradient accumulation, the perplexity after
each epoch and ``save_pretrained`` at the end.

Changed for this machine: the model comes from ``CONFIG_MAPPING[model_type]`` with tiny sizes
(1 layer, 32 dims) and the CPU (``Accelerator(cpu=True)``); the raw texts are made in code
(the ``datasets`` library is not installed here and nothing is downloaded); the tokenizer is a
byte tokenizer of this file (256 ids, no download). With ``--use_slow_tokenizer`` the train
texts are tokenized in the DataLoader's ``collate_fn``, batch by batch, by a pure-Python
tokenizer (``--tokenizer_work`` passes over each text stand for its CPU cost), as a streaming
pipeline does; the loaders keep the script's ``num_workers`` (0).
"""

import argparse
import logging
import math
import os
import random

import torch
from accelerate import Accelerator
from torch.utils.data.dataloader import DataLoader
from tqdm.auto import tqdm
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, SchedulerType, default_data_collator, get_scheduler

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Train a tiny causal language model without the Trainer")
    parser.add_argument("--model_type", type=str, default="gpt2", help="Model type to train from scratch.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--num_texts", type=int, default=400, help="raw texts made in code")
    parser.add_argument("--use_slow_tokenizer", action="store_true",
                        help="tokenize in the collate_fn with the pure-Python tokenizer")
    parser.add_argument("--tokenizer_work", type=int, default=40, help="the slow tokenizer's passes per text")
    args = parser.parse_args()
    if args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    return args


class ByteTokenizer:
    """Byte ids 0-255; ``slow`` adds a pure-Python normalisation pass per character, ``work`` times."""

    vocab_size = 256

    def __init__(self, slow=False, work=1):
        self.slow, self.work = slow, work

    def __call__(self, text):
        if self.slow:
            for _ in range(self.work):
                text = "".join(ch if ch.isprintable() else " " for ch in text)
        return {"input_ids": list(text.encode("utf8", "replace"))}


def raw_texts(count, seed):
    rng = random.Random(seed)
    words = ["the", "model", "learns", "from", "tokens", "and", "data", "on", "a", "small", "machine", "today"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(6, 40))) for _ in range(count)]


def group_texts(examples, block_size):
    """Every text's ids concatenated and cut into block_size chunks; labels are the inputs."""
    concatenated = [token for ids in examples["input_ids"] for token in ids]
    total_length = (len(concatenated) // block_size) * block_size
    blocks = [concatenated[i:i + block_size] for i in range(0, total_length, block_size)]
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


class TextBlocks(torch.utils.data.Dataset):
    """Raw text cut into pieces of about block_size bytes, tokenized later (by the collate)."""

    def __init__(self, texts, block_size):
        joined = " ".join(texts)
        self.pieces = [joined[i:i + block_size] for i in range(0, len(joined) - block_size, block_size)]

    def __len__(self):
        return len(self.pieces)

    def __getitem__(self, index):
        return self.pieces[index]


def main():
    args = parse_args()
    accelerator = Accelerator(cpu=True)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.WARNING)
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)

    raw_datasets = {"train": raw_texts(args.num_texts, args.seed), "validation": raw_texts(args.num_texts // 10, 1)}
    config = CONFIG_MAPPING[args.model_type](n_layer=1, n_head=2, n_embd=32, n_positions=args.block_size,
                                             vocab_size=ByteTokenizer.vocab_size, bos_token_id=0, eos_token_id=0)
    tokenizer = ByteTokenizer(slow=args.use_slow_tokenizer, work=args.tokenizer_work)
    model = AutoModelForCausalLM.from_config(config)
    block_size = args.block_size

    def tokenize_function(texts):
        return {"input_ids": [tokenizer(text)["input_ids"] for text in texts]}

    def rows(grouped):
        return [{"input_ids": ids, "labels": labels} for ids, labels in zip(grouped["input_ids"], grouped["labels"])]

    eval_dataset = rows(group_texts(tokenize_function(raw_datasets["validation"]), block_size))
    if args.use_slow_tokenizer:
        train_dataset = TextBlocks(raw_datasets["train"], block_size)

        def collate_fn(pieces):
            features = []
            for piece in pieces:
                ids = (tokenizer(piece)["input_ids"] + [0] * block_size)[:block_size]
                features.append({"input_ids": ids, "labels": list(ids)})
            return default_data_collator(features)
    else:
        train_dataset = rows(group_texts(tokenize_function(raw_datasets["train"]), block_size))
        collate_fn = default_data_collator

    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "ln_f.weight", "ln_1.weight", "ln_2.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    else:
        args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps, num_training_steps=args.max_train_steps)

    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                progress_bar.update(1)
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            losses.append(accelerator.gather(outputs.loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)[: len(eval_dataset)]
        try:
            perplexity = math.exp(torch.mean(losses))
        except OverflowError:
            perplexity = float("inf")
        logger.warning(f"epoch {epoch}: perplexity: {perplexity}")

    progress_bar.close()
    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(args.output_dir, save_function=accelerator.save)
    print(f"completed {completed_steps} optimizer steps")
    return completed_steps


if __name__ == "__main__":
    main()
