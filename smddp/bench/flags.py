"""The values the benchmark commands' flags share: sizes (4K, 16MiB, 4K-64M) and comma-separated lists."""

from __future__ import annotations


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_sizes(text: str) -> tuple[int, ...]:
    if "-" in text and "," not in text:
        lo, hi = (parse_size(x) for x in text.split("-"))
        out = []
        s = lo
        while s <= hi:
            out.append(s)
            s *= 4
        return tuple(out)
    return tuple(parse_size(x) for x in parse_list(text))
