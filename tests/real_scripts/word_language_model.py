"""A word-level language model trainer in the shape of PyTorch's examples/word_language_model/main.py.

Kept from that script's shape: its argparse options (``--model``, ``--emsize``, ``--nhid``,
``--nlayers``, ``--lr``, ``--clip``, ``--epochs``, ``--batch_size``, ``--bptt``, ``--dropout``,
``--log-interval``, ``--save``, ``--dry-run``, ``--use-optimizer``), a ``Corpus`` that tokenizes
its train/valid/test text into word ids, ``batchify`` into columns, ``get_batch(source, i)``
slicing ``bptt`` rows at a time, ``train()`` with hidden-state repackaging, gradient clipping and
either AdamW (``--use-optimizer``) or the example's manual SGD update, ``evaluate()`` after each
epoch, the model saved whenever the validation loss improves and the learning rate annealed
otherwise, Ctrl-C ending training early.

Changed for this machine: the device is the CPU and the sizes are tiny (an LSTM of 32 units);
the corpus text is made in code from a 200-word vocabulary instead of read from
``./data/wikitext-2`` (``--data`` is the folder the made-up files are written to);
``--read-latency`` (seconds per batch, default 0) makes ``get_batch`` read its rows from a slow
volume, as a corpus memory-mapped on network storage would; the ONNX export and the final test
of the saved model are left out.
"""

import argparse
import math
import os
import random
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="PyTorch word-level language model (tiny)")
parser.add_argument("--data", type=str, default="./data/made-up", help="folder of the made-up corpus")
parser.add_argument("--model", type=str, default="LSTM", help="type of network (RNN_TANH, RNN_RELU, LSTM, GRU)")
parser.add_argument("--emsize", type=int, default=32, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=32, help="number of hidden units per layer")
parser.add_argument("--nlayers", type=int, default=1, help="number of layers")
parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=2, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=8, metavar="N", help="batch size")
parser.add_argument("--bptt", type=int, default=16, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.0, help="dropout applied to layers")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=50, metavar="N", help="report interval")
parser.add_argument("--save", type=str, default="model.pt", help="path to save the final model")
parser.add_argument("--dry-run", action="store_true", help="verify the code and the model")
parser.add_argument("--use-optimizer", action="store_true", help="use AdamW for the updates")
parser.add_argument("--words", type=int, default=12_000, help="words in the made-up training text")
parser.add_argument("--read-latency", type=float, default=0.0, help="seconds to read one batch's rows")
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cpu")


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self, path):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(path, "train.txt"))
        self.valid = self.tokenize(os.path.join(path, "valid.txt"))
        self.test = self.tokenize(os.path.join(path, "test.txt"))

    def tokenize(self, path):
        ids = []
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in line.split() + ["<eos>"]:
                    ids.append(self.dictionary.add_word(word))
        return torch.tensor(ids, dtype=torch.int64)


def write_corpus(path, words):
    """train/valid/test text of a made-up 200-word vocabulary, 12 words a line."""
    os.makedirs(path, exist_ok=True)
    rng = random.Random(0)
    vocabulary = [f"w{index}" for index in range(200)]
    for name, count in (("train.txt", words), ("valid.txt", words // 10), ("test.txt", words // 10)):
        with open(os.path.join(path, name), "w", encoding="utf8") as f:
            for _line in range(0, count, 12):
                f.write(" ".join(rng.choice(vocabulary) for _ in range(12)) + "\n")


write_corpus(args.data, args.words)
corpus = Corpus(args.data)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 4
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)


class RNNModel(nn.Module):
    """Encoder, a recurrent module, decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ("LSTM", "GRU"):
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        else:
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=rnn_type[4:].lower(), dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.decoder.out_features)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


ntokens = len(corpus.dictionary)
model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
criterion = nn.NLLLoss()
if args.use_optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def repackage_hidden(h):
    """Hidden states detached from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    if args.read_latency:
        time.sleep(args.read_latency)  # the rows come from a slow volume
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].reshape(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


batches_trained = 0


def train():
    global batches_trained
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        if args.use_optimizer:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.use_optimizer:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        batches_trained += 1
        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} batches | lr {lr:02.2f} | "
                  f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f} | "
                  f"ppl {math.exp(cur_loss):8.2f}")
            total_loss = 0
            start_time = time.time()
        if args.dry_run:
            break


lr = args.lr
best_val_loss = None
try:
    for epoch in range(1, args.epochs + 1):
        epoch_start_time = time.time()
        train()
        val_loss = evaluate(val_data)
        print("-" * 89)
        print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | "
              f"valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}")
        print("-" * 89)
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, "wb") as f:
                torch.save(model.state_dict(), f)
            best_val_loss = val_loss
        else:
            lr /= 4.0
except KeyboardInterrupt:
    print("-" * 89)
    print("Exiting from training early")
print(f"trained {batches_trained} batches")
