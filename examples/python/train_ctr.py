"""Trains a click-through-rate model whose embedding table has a billion rows, through torchpar's parameter servers.

    torchrun --nproc-per-node=3 examples/python/train_ctr.py                 # 2 workers + 1 server
    torchrun --nproc-per-node=4 examples/python/train_ctr.py --servers 2     # 2 workers + 2 servers
    torchrun --nproc-per-node=3 examples/python/train_ctr.py --consistency bsp --epochs 3

The data is synthetic, like ad logs: every sample has --fields categorical features (site, ad, user, ...),
each a value drawn from a Zipf distribution over --vocab values (a few values are very frequent, most are
rare), and every (field, value) is hashed to one feature id in [0, --num-rows). Whether the sample is a
click follows a hidden rule: a fixed logistic model over the --hot most frequent values of every field
(the rest carry no signal), the label drawn from its probability, so even the rule itself scores an AUC
well below 1 (the "oracle" below).

The model looks up one --dim vector per feature id in a torchpar.ps.Embedding of --num-rows rows (a
sparse table: rows live on the servers, hashed over them, created when a batch first uses them, updated
by a row-wise Adagrad) and feeds their concatenation to a small MLP whose parameters are dense tables
(torchpar.ps.RemoteParameters, server-side Adam). Each worker trains on its own share of the samples.

Before and after training worker 0 scores the held-out samples (AUC and log-loss, against the base-rate
predictor and the hidden rule), and at the end it logs what the servers hold: the rows the data touched,
their bytes, and what a dense --num-rows x --dim table would need. Exit code: 0, or 1 when training did not
beat the untrained model and the base rate, or 2 for a wrong launch.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before the process group exists: see the end of main)
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import torchpar
import torchpar.ps

logger = logging.getLogger("torchpar.examples.train_ctr")
HASH_MULTIPLIER = 2654435761  # odd and prime to 5, so (x * it) mod 10^k is one-to-one for x < 10^k


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=None,
                        help="server ranks, the last ones (default: $TORCHPAR_PS_SERVERS, else 1)")
    parser.add_argument("--consistency", choices=["bsp", "ssp", "asp"], default="ssp")
    parser.add_argument("--staleness", type=int, default=2, help="SSP: steps a worker may run ahead")
    parser.add_argument("--num-rows", type=int, default=1_000_000_000, help="the embedding table's logical rows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=100_000, help="values per field")
    parser.add_argument("--zipf", type=float, default=1.1, help="exponent of the values' Zipf distribution")
    parser.add_argument("--hot", type=int, default=300, help="values per field that decide the label")
    parser.add_argument("--train-samples", type=int, default=200_000)
    parser.add_argument("--test-samples", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=500, help="per worker")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--embedding-lr", type=float, default=0.05, help="row-wise Adagrad")
    parser.add_argument("--lr", type=float, default=0.003, help="the MLP's Adam")
    parser.add_argument("--stats-interval", type=float, default=5.0, help="seconds between servers' stats lines")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_data(args: argparse.Namespace) -> dict:
    """Samples (feature ids [n, fields], labels [n]) and the hidden rule's logits; the same on every rank."""
    generator = torch.Generator().manual_seed(args.seed)
    # The hidden rule (drawn first: the same whatever the sample counts): a weight per hot value of every
    # field, cold values count 0; the label is then drawn from the rule's probability.
    weights = torch.randn(args.fields, args.hot, generator=generator, dtype=torch.float64) * 0.8
    n = args.train_samples + args.test_samples
    popularity = torch.arange(1, args.vocab + 1, dtype=torch.float64).pow(-args.zipf).cumsum(0)
    values = torch.searchsorted(popularity / popularity[-1], torch.rand(n, args.fields, generator=generator,
                                                                        dtype=torch.float64))
    values.clamp_(max=args.vocab - 1)  # [n, fields]: 0 is each field's most frequent value
    hot = values < args.hot
    contribution = weights.gather(1, values.clamp(max=args.hot - 1).T).T * hot
    logits = -1.5 + contribution.sum(dim=1)
    labels = torch.bernoulli(torch.sigmoid(logits), generator=generator).float()
    # (field, value) -> a feature id in [0, num_rows): a multiplicative hash, one-to-one on this data.
    keys = torch.arange(args.fields).mul(args.vocab) + values
    ids = (keys * HASH_MULTIPLIER + 12345) % args.num_rows
    split = args.train_samples
    return {"train_ids": ids[:split], "train_y": labels[:split], "test_ids": ids[split:], "test_y": labels[split:],
            "test_logits": logits[split:].float()}


class CTRModel(nn.Module):
    def __init__(self, embedding: torchpar.ps.Embedding, fields: int, dim: int, hidden: int):
        super().__init__()
        self.embedding = embedding
        self.head = nn.Sequential(nn.Linear(fields * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).flatten(1)).squeeze(1)  # the click logit


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the chance a random click scores above a random non-click."""
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    positives = float(labels.sum())
    negatives = len(labels) - positives
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(F.binary_cross_entropy_with_logits(logits, labels))


@torch.no_grad()
def score(model: CTRModel, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(AUC, log-loss) of the model on these samples (its forward pulls their rows)."""
    model.eval()
    logits = torch.cat([model(chunk) for chunk in ids.split(5000)])
    model.train()
    return auc(logits, labels), log_loss(logits, labels)


def train(args: argparse.Namespace, service: torchpar.ps.ParameterService, data: dict) -> tuple[bool, int]:
    """A worker's part. Returns (whether the model beat the untrained one and the base rate, the number
    of distinct feature ids any batch or evaluation used: the rows the servers should hold)."""
    worker, workers = service.worker_index, service.num_workers
    embedding = torchpar.ps.Embedding(service.client, "ctr.embedding", args.num_rows, args.dim,
                                      optimizer=torchpar.ps.Adagrad(args.embedding_lr),
                                      initializer=torchpar.ps.normal(0.0, 0.01, seed=args.seed))
    torch.manual_seed(args.seed)
    model = CTRModel(embedding, args.fields, args.dim, args.hidden)
    params = torchpar.ps.RemoteParameters(model.head, service.client, torchpar.ps.Adam(args.lr), prefix="ctr.head.")

    steps_per_epoch = args.train_samples // (workers * args.batch_size)
    used = steps_per_epoch * workers * args.batch_size  # samples some batch feeds (the rest are dropped)
    train_ids, train_y = data["train_ids"][:used], data["train_y"][:used]
    test_ids, test_y = data["test_ids"], data["test_y"]
    probe = slice(0, min(used, args.test_samples))  # training samples scored for the training AUC
    consistency = args.consistency + (f" (staleness {args.staleness})" if args.consistency == "ssp" else "")
    if worker == 0:
        base_rate = float(train_y.mean())
        base_loss = log_loss(torch.full_like(test_y, torch.logit(torch.tensor(base_rate)).item()), test_y)
        logger.info("%d fields x %d values (Zipf %.2f), hashed into %s feature ids; %.1f%% clicks; "
                    "%d training samples, %d held out", args.fields, args.vocab, args.zipf, f"{args.num_rows:,}",
                    100 * base_rate, used, len(test_y))
        logger.info("model: Embedding(%s, %d) on the servers (Adagrad %g) + MLP %d-%d-1 (Adam %g); "
                    "%d workers + %d server(s), %s, %d epochs of %d steps, batch %d per worker",
                    f"{args.num_rows:,}", args.dim, args.embedding_lr, args.fields * args.dim, args.hidden, args.lr,
                    workers, service.num_servers, consistency, args.epochs, steps_per_epoch, args.batch_size)
        logger.info("held-out: base-rate predictor log-loss %.4f (AUC 0.5); the hidden rule AUC %.4f, "
                    "log-loss %.4f", base_loss, auc(data["test_logits"], test_y),
                    log_loss(data["test_logits"], test_y))
        before_auc, before_loss = score(model, test_ids, test_y)
        logger.info("untrained: held-out AUC %.4f, log-loss %.4f", before_auc, before_loss)
    dist.barrier(group=service.worker_group)  # the others start training once the untrained model is scored

    from tqdm import tqdm

    loss_fn = nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    progress = tqdm(total=args.epochs * steps_per_epoch, desc="train", unit="step", disable=worker != 0)
    for epoch in range(args.epochs):
        # This worker's share: every workers-th sample, in an order that changes every epoch.
        order = torch.randperm(used // workers, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        mine = torch.arange(worker, used, workers)[order]
        for batch in mine.split(args.batch_size):
            loss = loss_fn(model(train_ids[batch]), train_y[batch])
            loss.backward()  # the MLP's gradients go to the servers as backward makes them; so do the rows'
            params.step()
            progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.4f}", refresh=False)
            progress.update()
    embedding.flush()  # the last batch's row gradients have reached the servers
    progress.close()
    seconds = time.perf_counter() - start

    dist.barrier(group=service.worker_group)  # every worker's last push is in
    params.pull()
    succeeded = True
    if worker == 0:
        train_auc, train_loss = score(model, train_ids[probe], train_y[probe])
        test_auc, test_loss = score(model, test_ids, test_y)
        logger.info("trained %d steps of %d workers in %.1f s (%.0f samples/s)", args.epochs * steps_per_epoch,
                    workers, seconds, args.epochs * used / seconds)
        logger.info("trained: training AUC %.4f, log-loss %.4f; held-out AUC %.4f, log-loss %.4f "
                    "(untrained %.4f, %.4f; base rate log-loss %.4f)", train_auc, train_loss, test_auc, test_loss,
                    before_auc, before_loss, base_loss)
        succeeded = test_auc > before_auc + 0.05 and test_loss < base_loss
    verdict = torch.tensor([int(succeeded)])
    dist.broadcast(verdict, group_src=0, group=service.worker_group)
    params.remove()
    touched = torch.cat([train_ids.flatten(), test_ids.flatten()]).unique().numel()
    return bool(verdict), touched


def report_memory(args: argparse.Namespace, service: torchpar.ps.ParameterService, summary: dict | None,
                  touched: int) -> tuple[int, int]:
    """Collective over the world: the servers' rows and bytes of the embedding table, summed."""
    rows_bytes = torch.zeros(2, dtype=torch.float64)
    if summary is not None:
        for table in summary["tables"]:
            if table["sparse"]:
                rows_bytes += torch.tensor([table["rows_touched"], table["bytes"]], dtype=torch.float64)
                logger.info("server %d: table '%s' holds %d rows touched, %.1f MB (%.0f bytes per row)",
                            service.server_index, table["name"], table["rows_touched"], table["bytes"] / 1e6,
                            table["bytes"] / max(1, table["rows_touched"]))
    dist.all_reduce(rows_bytes)
    rows, held = int(rows_bytes[0]), int(rows_bytes[1])
    if dist.get_rank() == 0:
        dense = args.num_rows * args.dim * 4
        logger.info("embedding rows touched: %d of %d (%.4f%%; the data's distinct feature ids: %d)", rows,
                    args.num_rows, 100 * rows / args.num_rows, touched)
        logger.info("embedding memory on %d server(s): %.1f MB = %.0f bytes per touched row "
                    "(a row: %d values + %d Adagrad sums of 4 bytes, its id, its index entry, and the slack of "
                    "tables that double as they grow); a dense %d x %d "
                    "float32 table would need %.1f GB, %.1f GB with its Adagrad state", service.num_servers,
                    held / 1e6, held / max(1, rows), args.dim, args.dim, args.num_rows, args.dim, dense / 1e9,
                    2 * dense / 1e9)
    return rows, held


def main() -> int:
    args = parse_args()
    try:
        torchpar.init_process_group()
    except torchpar.LaunchError as error:
        print(f"train_ctr.py: {error}", file=sys.stderr)
        return 2
    rank = dist.get_rank()
    try:
        service = torchpar.ps.ParameterService(servers=args.servers, consistency=args.consistency,
                                               staleness=args.staleness, stats_interval=args.stats_interval)
    except RuntimeError as error:  # e.g. --servers leaving no worker
        if rank == 0:
            print(f"train_ctr.py: {error}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    # Worker 0 logs the training; the servers log their tables and statistics lines.
    logging.basicConfig(level=logging.INFO if rank == 0 or service.is_server else logging.WARNING,
                        format="%(message)s")

    result = torch.tensor([0])  # 1: the model learned (worker 0's verdict, max over the world)
    touched, summary = 0, None
    if service.is_server:
        summary = service.serve()  # until every worker has finished
        logger.info("server %d of %d (rank %d): %d requests, %.1f MB in, %.1f MB out, staleness at most %d",
                    service.server_index, service.num_servers, rank, summary["requests"], summary["bytes_in"] / 1e6,
                    summary["bytes_out"] / 1e6, summary["max_staleness"])
    else:
        learned, touched = train(args, service, make_data(args))
        result.fill_(int(learned))
        service.finish()
    report_memory(args, service, summary, touched)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if not result.item() and rank == 0:
        logger.error("the model did not learn: held-out AUC not above the untrained model's, or log-loss not "
                     "below the base rate's")
    # The service holds process groups: close it before the default group goes (see train_pipeline.py).
    service.close()
    del service
    dist.destroy_process_group()
    return 0 if result.item() else 1


if __name__ == "__main__":
    sys.exit(main())
