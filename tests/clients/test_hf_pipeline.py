"""A Hugging Face transformers GPT-2 (built from a config: random weights, no download) cut into pipeline stages on
2 ranks: the embedding stage (wte + wpe), the transformer blocks, and the head (ln_f + lm_head, whose weight is wte's).
The tie is found (one Parameter in the first and last layers) or declared (layers built by factories on their own
ranks); two SGD steps equal one process for every schedule, and the ranks' copies of the tied matrix stay one."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpar.pipeline
from rank_harness import run_on_ranks

transformers = pytest.importorskip("transformers")
BATCH, LENGTH, VOCABULARY, LR = 8, 12, 64, 0.1
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2)]


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=16,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).train()


class Embedding(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Block(nn.Module):
    def __init__(self, model, index):
        super().__init__()
        self.block = model.transformer.h[index]

    def forward(self, hidden):
        return self.block(hidden)  # no mask: causal attention


class Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden):
        return self.lm_head(self.ln_f(hidden))


# The layers' parameters' names in the whole model.
PREFIXES = {0: {"wte": "transformer.wte", "wpe": "transformer.wpe"}, 1: {"block": "transformer.h.0"},
            2: {"block": "transformer.h.1"}, 3: {"ln_f": "transformer.ln_f", "lm_head": "lm_head"}}


def stages_of(model):
    return [Embedding(model), Block(model, 0), Block(model, 1), Head(model)]


def next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCABULARY), ids[:, 1:].reshape(-1))


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCABULARY, (BATCH, LENGTH), generator=generator) for _ in range(2)]


def reference():
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for ids in batches():
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    parameters = dict(model.named_parameters())  # lists the tied matrix once, as wte's
    parameters["lm_head.weight"] = model.lm_head.weight
    return losses, parameters


def train_and_compare(pipe, built, expected_losses, expected, what):
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    for step, ids in enumerate(batches()):
        optimizer.zero_grad()
        loss = pipe.step(ids if pipe.is_first_stage else None, ids if pipe.is_last_stage else None)
        optimizer.step()
        assert abs(loss.item() - expected_losses[step]) <= 1e-5, (what, step, loss.item(), expected_losses[step])
    for layer, module in built.items():
        for name, parameter in module.named_parameters():
            child, _, rest = name.partition(".")
            full = f"{PREFIXES[layer][child]}.{rest}"
            difference = (parameter - expected[full]).abs().max().item()
            assert difference <= 1e-5, f"{what}: {full} differs from one process by {difference:.3g}"
    held = (built[0].wte.weight if 0 in built else built[3].lm_head.weight).detach()
    copies = [torch.empty_like(held) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, held.contiguous())
    assert torch.equal(copies[0], copies[1]), f"{what}: the ranks' copies of the tied matrix differ"


def gpt2_pipelines(rank, world):
    expected_losses, expected = reference()
    found = {}
    for schedule, virtual_stages in SCHEDULES:
        layers = stages_of(gpt2())
        assert layers[3].lm_head.weight is layers[0].wte.weight
        if rank == 1:  # this rank's copy starts elsewhere: the pipeline starts it from the embedding's rank
            with torch.no_grad():
                layers[3].lm_head.weight.mul_(2.0)
        pipe = torchpar.pipeline.Pipeline(layers, next_token_loss, schedule=schedule, microbatches=4,
                                          virtual_stages=virtual_stages)
        found[schedule] = pipe.shared_parameters
        train_and_compare(pipe, dict(pipe._built), expected_losses, expected, schedule)

    # Factories: each rank builds only its own stages, separate modules whose tie must be declared.
    factories = [lambda: stages_of(gpt2())[0], lambda: stages_of(gpt2())[1], lambda: stages_of(gpt2())[2],
                 lambda: stages_of(gpt2())[3]]
    pipe = torchpar.pipeline.Pipeline(factories, next_token_loss, schedule="1f1b", microbatches=4,
                                      shared_parameters=[["0.wte.weight", "3.lm_head.weight"]])
    train_and_compare(pipe, dict(pipe._built), expected_losses, expected, "factories, declared")
    return found


def test_gpt2_with_tied_embedding_pipelined_equals_one_process_for_every_schedule():
    for found in run_on_ranks(2, gpt2_pipelines, deadline_s=300):
        for schedule, groups in found.items():
            assert groups == [[(0, "wte.weight"), (3, "lm_head.weight")]], (schedule, groups)
