"""What a quantizer run did: counts, bytes, QSNR, time and peak memory."""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass, field


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class QuantizeReport:
    src: str
    dst: str
    scheme: str
    weight_format: str
    device: str
    n_quantized: int = 0
    n_kept: int = 0
    weights_quantized: int = 0  # elements of the quantized weights
    bytes_in: int = 0  # tensor data bytes read (headers excluded)
    bytes_out: int = 0  # tensor data bytes written
    shards: int = 0
    qsnr_db: dict[str, float] = field(default_factory=dict)  # mean weight QSNR per format
    seconds: float = 0.0
    peak_rss: int = 0
    unquantized_modules: list[str] = field(default_factory=list)
    unused_ignore: list[str] = field(default_factory=list)

    @property
    def weights_per_second(self) -> float:
        return self.weights_quantized / self.seconds if self.seconds > 0 else math.nan

    def summary(self) -> str:
        ratio = self.bytes_in / self.bytes_out if self.bytes_out else math.nan
        qs = ", ".join(f"{k} {v:.2f} dB" for k, v in self.qsnr_db.items()) or "n/a"
        lines = [
            f"wrote {self.dst} ({self.shards} shard{'s' if self.shards != 1 else ''}), "
            f"scheme {self.scheme} (weights {self.weight_format}) on {self.device}",
            f"  tensors: {self.n_quantized} quantized, {self.n_kept} kept "
            f"({len(self.unquantized_modules)} unquantized linear/embedding modules)",
            f"  bytes:   {_gib(self.bytes_in)} -> {_gib(self.bytes_out)} ({ratio:.2f}x smaller)",
            f"  QSNR:    mean weight QSNR {qs}",
            f"  time:    {self.seconds:.1f} s ({self.weights_per_second / 1e6:.2f} M weights/s); "
            f"peak RSS {_gib(self.peak_rss)}",
        ]
        if self.unused_ignore:
            lines.append(
                f"  warning: --ignore patterns matched nothing: {', '.join(self.unused_ignore)}"
            )
        return "\n".join(lines)
