"""Small models shared by the tests: tiny tied-embedding language models."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, CONTEXT = 61, 32, 16


class TinyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True, dropout=0.0)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token + position embeddings, two blocks, a head tied to the token embedding."""

    def __init__(self, layers: int = 2, width: int = WIDTH):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


class TiedGPT(nn.Module):
    """GPT-2's layout in small: token and position embeddings as nn.Embedding modules, residual
    MLP blocks, a final norm and a head tied to the token embedding. Every parameter belongs to
    the module whose forward reads it."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def make_model(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def batch(rank: int, step: int, micro: int = 0, size: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=generator)


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token windows: the same on every rank, split by the DistributedSampler."""

    def __init__(self, size: int = 64, seed: int = 0, repeat: int = 1):
        self.tokens = torch.randint(0, VOCAB, (size, CONTEXT + 1), generator=torch.Generator().manual_seed(seed))
        self.repeat = repeat  # each window `repeat` times in a row: with repeat = world, every rank sees the same data

    def __len__(self) -> int:
        return len(self.tokens) * self.repeat

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index // self.repeat]


def _lightning():
    import lightning.pytorch as pl

    return pl


class TinyLMModule(_lightning().LightningModule):
    """TinyLM trained with AdamW (decay and no-decay groups) and a per-step LR schedule."""

    def __init__(
        self,
        lr: float = 1e-2,
        batch_size: int = 4,
        dataset_size: int = 64,
        layers: int = 2,
        loss_scale: float = 1.0,
        repeat: int = 1,
    ):
        super().__init__()
        self.lr, self.batch_size, self.dataset_size = lr, batch_size, dataset_size
        self.loss_scale, self.repeat = loss_scale, repeat
        self.model = make_model(0, layers=layers)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss * self.loss_scale

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=self.lr
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        dataset = TokenDataset(self.dataset_size, repeat=self.repeat)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TokenDataset(16, seed=1), batch_size=self.batch_size)
