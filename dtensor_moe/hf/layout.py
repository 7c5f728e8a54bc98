"""How Hugging Face checkpoints store the routed experts, and the reads that turn a box of
torchtitan's experts.w1/w2/w3/b1/b2/b3 into exactly the matching box of theirs (our w13 / b13 are
w1 and w3 / b1 and b3 stacked on dim 1: hf/convert.py reads and writes them as those).

Three layouts (transformers 5.x; keys relative to the MoE block):
- `PerExpert`: what save_pretrained writes and the Hub holds for Qwen3-MoE, Mixtral and DeepSeek-V3:
  experts.{e}.{gate}.weight [F, D], .{up}.weight [F, D], .{down}.weight [D, F].
- `Fused`: the same families' modules in memory: experts.gate_up_proj [E, 2F, D] (gate rows, then
  up rows), experts.down_proj [E, D, F].
- `GptOss`: experts.gate_up_proj [E, D, 2F] with gate and up interleaved on the last dim (gate at
  even columns), gate_up_proj_bias [E, 2F] likewise, down_proj [E, F, D], down_proj_bias [E, D];
  on disk and in memory alike.
"""

import torch


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def _twice(s: slice) -> slice:
    return slice(2 * s.start, 2 * s.stop)


def full_box(shape) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


class PerExpert:
    def __init__(self, prefix: str, gate: str, up: str, down: str):
        self.prefix, self.names = prefix, {"w1": gate, "w3": up, "w2": down}

    def key(self, e: int, name: str) -> str:
        return f"{self.prefix}experts.{e}.{self.names[name]}.weight"

    def read(self, reader, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        experts, rest = box[0], box[1:]
        rows = [reader.read(self.key(e, name), rest) for e in range(experts.start, experts.stop)]
        if rows:
            return torch.stack(rows)
        empty = reader.read(self.key(0, name), tuple(slice(0, 0) for _ in rest))
        return empty.new_empty([0] + [s.stop - s.start for s in rest])

    def write(self, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.key(e, name): ours[name][e].contiguous() for name in ("w1", "w3", "w2")
                for e in range(ours["w1"].shape[0])}


class Fused:
    def __init__(self, prefix: str, num_hidden: int):
        self.gate_up, self.down, self.F = f"{prefix}experts.gate_up_proj", f"{prefix}experts.down_proj", num_hidden

    def read(self, reader, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if name == "w2":
            return reader.read(self.down, box)
        E, F_, D = box
        return reader.read(self.gate_up, (E, F_ if name == "w1" else _shift(F_, self.F), D))

    def write(self, ours):
        return {self.gate_up: torch.cat([ours["w1"], ours["w3"]], dim=1), self.down: ours["w2"]}


class GptOss:
    def __init__(self, prefix: str):
        p = f"{prefix}experts."
        self.gate_up, self.gate_up_bias, self.down, self.down_bias = (
            p + k for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))

    def read(self, reader, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        # Gate and up columns interleave: the box's F range is a contiguous range of 2F columns,
        # read once for each of w1 and w3 and split by parity.
        parity = 0 if name in ("w1", "b1") else 1
        if name in ("w1", "w3"):
            E, F_, D = box
            return reader.read(self.gate_up, (E, D, _twice(F_)))[..., parity::2].transpose(1, 2).contiguous()
        if name in ("b1", "b3"):
            E, F_ = box
            return reader.read(self.gate_up_bias, (E, _twice(F_)))[:, parity::2].contiguous()
        if name == "w2":
            E, D, F_ = box
            return reader.read(self.down, (E, F_, D)).transpose(1, 2).contiguous()
        return reader.read(self.down_bias, box)

    def write(self, ours):
        E, F_, D = ours["w1"].shape
        pair = torch.stack([ours["w1"].transpose(1, 2), ours["w3"].transpose(1, 2)], dim=-1)
        return {
            self.gate_up: pair.reshape(E, D, 2 * F_).contiguous(),
            self.gate_up_bias: torch.stack([ours["b1"], ours["b3"]], dim=-1).reshape(E, 2 * F_).contiguous(),
            self.down: ours["w2"].transpose(1, 2).contiguous(),
            self.down_bias: ours["b2"].contiguous(),
        }
