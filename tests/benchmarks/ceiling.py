"""The physical-limit column: a run's tokens/s against what the GPU could do at most.

Two bounds, both for a dense decoder run in bf16 on one GPU:

- **compute ceiling** (throughput runs): every token, prompt or output, costs about
  `2 * params` FLOPs (one multiply-add per weight; attention's own FLOPs are left out, which
  is small at 4K contexts), so total tokens/s <= achieved FLOP/s / (2 * params). Issue 18
  puts the H200 at ~790 TFLOP/s measured on bf16 matmuls (80% of the 989.4 TFLOP/s dense
  datasheet figure), which for Qwen3-14B (14.77 B parameters) is ~26.7K tokens/s: the
  "~27K tok/s" of the issue. Only *computed* tokens count: a prompt token found in the
  prefix cache costs no prefill (`computed_tokens`), so on workload P a run's total
  tokens/s can pass the ceiling (205% with placement) while its computed tokens/s cannot.
- **weight-read floor** (low batch): a decode step reads every weight once, so a step takes
  at least `bytes of weights / memory bandwidth`; with `b` sequences decoding, output
  tokens/s <= b / that floor (a lone request: one token per floor).

Sources of the constants (datasheets, dense figures without sparsity): NVIDIA H200
(HGX/SXM): 989.4 TFLOP/s bf16, 4.8 TB/s HBM3e; H100 SXM5 80GB: 989.4 TFLOP/s bf16,
3.35 TB/s HBM3; H100 PCIe: 756 TFLOP/s, 2.0 TB/s. H100 SXM and H200 share the GH100 compute
die, so their compute ceilings are the same; an H100 differs in its weight-read floor
(3.35 vs 4.8 TB/s). For another device the ceiling is scaled by its datasheet bf16 figure
against the H200's (the measured-to-datasheet ratio, 790 / 989.4, is assumed to carry).
Parameter count from `tests/fixtures/qwen3-14b/config.json` (`qwen3_params`). Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEASURED_TFLOPS_H200 = 790.0  # issue 18: measured bf16 matmul throughput on the lent H200
BYTES_PER_PARAM_BF16 = 2


@dataclass(frozen=True)
class Device:
    name: str
    bf16_tflops: float  # datasheet, dense
    mem_tb_s: float  # datasheet memory bandwidth


DEVICES: dict[str, Device] = {
    "H200": Device("NVIDIA H200", 989.4, 4.8),
    "H100": Device("NVIDIA H100 80GB HBM3 (SXM)", 989.4, 3.35),
    "H100 PCIe": Device("NVIDIA H100 PCIe", 756.0, 2.0),
}


def device_for(gpu_name: str) -> Device | None:
    """The DEVICES entry for an `nvidia-smi` name ("NVIDIA H100 80GB HBM3", "1x NVIDIA H200")."""
    name = gpu_name.upper()
    if "H200" in name:
        return DEVICES["H200"]
    if "H100" in name:
        return DEVICES["H100 PCIe"] if "PCIE" in name else DEVICES["H100"]
    return None


def qwen3_params(config: dict[str, Any]) -> int:
    """Weights of a dense Qwen3 from its config.json (norms included, biases none)."""
    h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or h // int(config["num_attention_heads"]))
    q = int(config["num_attention_heads"]) * head_dim
    kv = int(config["num_key_value_heads"]) * head_dim
    attn = h * q + 2 * h * kv + q * h + 2 * head_dim  # q, k, v, o; q/k norms
    mlp = 3 * h * int(config["intermediate_size"])
    per_layer = attn + mlp + 2 * h  # two RMS norms
    embed = int(config["vocab_size"]) * h
    head = 0 if config.get("tie_word_embeddings") else embed
    return layers * per_layer + embed + head + h  # + the final norm


def model_params(model_dir: Path) -> int:
    return qwen3_params(json.loads((model_dir / "config.json").read_text()))


def compute_ceiling_tok_s(params: int, tflops: float) -> float:
    """Total (prompt + output) tokens/s at `tflops` achieved: tflops / (2 * params)."""
    return tflops * 1e12 / (2 * params)


def weight_read_floor_s(params: int, mem_tb_s: float, bytes_per_param: int = 2) -> float:
    """The least time one decode step can take: all weights read once from memory."""
    return params * bytes_per_param / (mem_tb_s * 1e12)


def device_tflops(device: Device) -> float:
    """Achieved bf16 TFLOP/s assumed for `device`: the H200's measured figure, scaled by
    the datasheet ratio (the same for an H100 SXM, which has the same compute)."""
    return MEASURED_TFLOPS_H200 * device.bf16_tflops / DEVICES["H200"].bf16_tflops


def limits(params: int, device: Device, tflops: float | None = None) -> dict[str, float]:
    """The two bounds for `device` (tflops: override the achieved figure)."""
    achieved = tflops if tflops is not None else device_tflops(device)
    floor = weight_read_floor_s(params, device.mem_tb_s, BYTES_PER_PARAM_BF16)
    return {
        "tflops": round(achieved, 1),
        "ceiling_total_tok_s": round(compute_ceiling_tok_s(params, achieved), 1),
        "weight_read_floor_ms": round(floor * 1000, 3),
        "lone_decode_max_tok_s": round(1 / floor, 1),
    }


def computed_tokens(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """Tokens the GPU ran through the model: prompt tokens not served from the prefix cache,
    and every output token."""
    return prompt_tokens - cached_tokens + completion_tokens


def computed_rate(row: dict[str, Any], seconds: float) -> float:
    """A benchmark row's computed tokens/s (its `prompt_tokens`, `cached_tokens`,
    `completion_tokens` over `seconds`)."""
    tokens = computed_tokens(
        int(row["prompt_tokens"]), int(row.get("cached_tokens") or 0), int(row["completion_tokens"])
    )
    return tokens / seconds if seconds > 0 else 0.0


def share_of_ceiling(total_tok_s: float, ceiling_tok_s: float) -> float:
    """A run's total tokens/s as a fraction of the compute ceiling."""
    return round(total_tok_s / ceiling_tok_s, 3) if ceiling_tok_s > 0 else 0.0


def column(total_tok_s: float, gpu_name: str, params: int) -> str:
    """The table cell: `12,345 = 46% of 26.7K` ('n/a' on an unknown device). Pass computed
    tokens/s (`computed_rate`) where a run has prefix-cache hits."""
    device = device_for(gpu_name)
    if device is None:
        return "n/a (no known GPU)"
    ceiling = limits(params, device)["ceiling_total_tok_s"]
    return (
        f"{total_tok_s:,.0f} = {share_of_ceiling(total_tok_s, ceiling):.0%} of "
        f"{ceiling / 1000:.1f}K"
    )
