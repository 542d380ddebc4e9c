"""What a program holds, read from its HLO text: its low-precision sums, its kernels and its matmul FLOPs.

The HLO text is either optimized (`compiled.as_text()`) or as JAX lowered it (`lowered.as_text(dialect="hlo")`,
what every platform's compiler is given).

- `low_precision_sums`: every reduction and scatter whose sum is taken in bfloat16 or float16 (its reducer adds
  in that type): a reduce, reduce-window, scatter, select-and-scatter, all-reduce or reduce-scatter. A
  training step should have none (models/precision.py): bf16 sums lose addends, and on Hopper a bf16
  scatter-add is a compare-and-swap loop per element. Maxima and minima in bf16 are exact and not listed.
- `kernels`: the kernels the program launches, counted from its scheduled computations (the entry, loop bodies
  and conditions, branches): each fusion, custom call (cuDNN, cuBLAS, Triton, Mosaic) and unfused operation
  is one kernel; bookkeeping operations (parameters, constants, tuples, bitcasts, control flow) are none. Per
  step, a loop body's kernels run once per trip (`launches`, from XLA's known trip count).
- `matmul_flops`: the FLOPs of every dot and convolution the program runs per call (fused or not, loop bodies
  once per trip): what a step computes in matmuls, recompute included. Custom calls (cuDNN's or Mosaic's
  attention, cuBLAS) are not counted: their FLOPs are not in the HLO.
"""
from __future__ import annotations

import dataclasses
import re

LOW_PRECISION = ("bf16", "f16")
_SUM_OPS = ("reduce", "reduce-window", "scatter", "select-and-scatter", "all-reduce", "reduce-scatter",
            "all-reduce-start")
# Operations that launch nothing: bookkeeping, control flow (its bodies are counted on their own), the waits of
# asynchronous pairs (any "-done"; the "-start" is the kernel).
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
         "after-all", "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "async-update"}

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-$]+)(?: \(.*\) -> .*)? \{$")     # optimized, or as lowered
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-$]+) = (\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?|[\w]+\[\]|token\[\]) "
                          r"([\w\-]+)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    computation: str
    name: str
    type: str            # e.g. "bf16[768]{0}" or "(f32[], s32[])"
    opcode: str
    text: str            # the rest of the line after the opcode's "("
    root: bool = False

    @property
    def element_type(self) -> str:
        return re.match(r"\(?\s*(\w+)", self.type).group(1)

    def called(self, attribute: str) -> list[str]:
        """Names of the computations this instruction calls through `attribute` (to_apply, calls, body, ...)."""
        found = re.findall(rf"\b{attribute}=\{{?([^,}}]+(?:, *%?[\w.\-$]+)*)\}}?", self.text)
        return [name.strip().lstrip("%") for group in found for name in group.split(",")]


@dataclasses.dataclass
class Program:
    computations: dict[str, list[Instruction]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> "Program":
        computations: dict[str, list[Instruction]] = {}
        entry, current = "", None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                current = header.group(2)
                computations[current] = []
                if header.group(1):
                    entry = current
                continue
            if line.startswith("}"):
                current = None
                continue
            if current is None:
                continue
            m = _INSTRUCTION.match(line)
            if m:
                computations[current].append(Instruction(current, m.group(2), m.group(3), m.group(4), m.group(5),
                                                         bool(m.group(1))))
        return cls(computations, entry)

    def reducer_type(self, name: str) -> str | None:
        """The type a reducer computation accumulates in (its result's: XLA:CPU computes a bf16 `add` in float32
        and rounds each partial sum back), or None when it does not add (a maximum, a logical and)."""
        instructions = self.computations.get(name, [])
        if not any(ins.opcode == "add" for ins in instructions):
            return None
        return next((ins.element_type for ins in instructions if ins.root), None)

    def low_precision_sums(self) -> list[Instruction]:
        """Every reduction or scatter that adds in bf16 or f16, wherever it is (fused or not). A reduction over
        axes of size 1 (XLA:TPU writes some reshapes so) adds nothing and is not listed."""
        out = []
        for instructions in self.computations.values():
            shapes = {ins.name: ins.type for ins in instructions}
            for ins in instructions:
                if ins.opcode not in _SUM_OPS:
                    continue
                reducers = ins.called("to_apply") + ins.called("scatter")
                if not any(self.reducer_type(r) in LOW_PRECISION for r in reducers):
                    continue
                if ins.opcode == "reduce" and _reduced_size(ins, shapes) == 1:
                    continue
                out.append(ins)
        return out

    def scheduled(self) -> dict[str, int]:
        """The computations that run as a sequence of kernels, each with how many times it runs per call of the
        program (loop bodies: their known trip count, else 1)."""
        runs = {self.entry: 1}
        queue = [self.entry]
        while queue:
            name = queue.pop()
            for ins in self.computations.get(name, []):
                if ins.opcode == "while":
                    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
                    n = int(trips.group(1)) if trips else 1
                    targets = [(c, n) for c in ins.called("body") + ins.called("condition")]
                elif ins.opcode == "conditional":
                    targets = [(c, 1) for c in ins.called("branch_computations")
                               + ins.called("true_computation") + ins.called("false_computation")]
                elif ins.opcode == "call":
                    targets = [(c, 1) for c in ins.called("to_apply")]
                else:
                    continue
                for c, n in targets:
                    if c in self.computations and c not in runs:
                        runs[c] = runs[name] * n
                        queue.append(c)
        return runs

    def kernels(self) -> tuple[int, int]:
        """(kernels in the program, kernel launches per call: loop bodies counted once per trip)."""
        static = launches = 0
        for name, runs in self.scheduled().items():
            count = sum(1 for ins in self.computations[name] if _launches(ins))
            static += count
            launches += count * runs
        return static, launches


    def matmul_flops(self) -> int:
        """FLOPs of the dots and convolutions run per call of the program (2 per multiply-add), with each
        computation counted as often as it runs: loop bodies per trip, fusions as often as their caller."""
        total = 0

        def visit(name: str, runs: int) -> None:
            nonlocal total
            instructions = self.computations.get(name, [])
            shapes = {ins.name: ins.type for ins in instructions}
            for ins in instructions:
                if ins.opcode in ("dot", "convolution"):
                    total += runs * _matmul_flops(ins, shapes)
                if ins.opcode in ("fusion", "async-start", "custom-call"):
                    for called in ins.called("calls"):
                        visit(called, runs)

        for name, runs in self.scheduled().items():
            visit(name, runs)
        return total


def _operands(ins: Instruction) -> list[str]:
    """The operand names of an instruction (printed `%a, %b`, or with their types, `f32[2]{0} %a, ...`)."""
    return re.findall(r"%([\w.\-$]+)", ins.text.split(")", 1)[0])


def _matmul_flops(ins: Instruction, shapes: dict[str, str]) -> int:
    out = _dims(ins.type) or []
    operands = _operands(ins)
    if len(operands) < 2:
        return 0
    lhs, rhs = _dims(shapes.get(operands[0], "")), _dims(shapes.get(operands[1], ""))
    size = 1
    for d in out:
        size *= d
    if ins.opcode == "dot":
        axes = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.text)
        if lhs is None or axes is None:
            return 0
        for a in (int(x) for x in axes.group(1).split(",") if x):
            size *= lhs[a]
        return 2 * size
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.text)        # convolution: the kernel's labels, e.g. 01io
    if rhs is None or labels is None or "o" not in labels.group(1) or len(labels.group(1)) != len(rhs):
        return 0
    window = 1
    for label, d in zip(labels.group(1), rhs):
        if label != "o":
            window *= d
    return 2 * size * window          # each output sums over the kernel's window and input features (per group)


def matmul_flops(text: str) -> int:
    """Per call of the optimized (or lowered) HLO `text`: FLOPs of its dots and convolutions (`Program.matmul_flops`)."""
    return Program.parse(text).matmul_flops()


def _launches(ins: Instruction) -> bool:
    """Whether the instruction runs a kernel: not bookkeeping, and not the wait of an asynchronous pair (its
    "-start" is the kernel)."""
    return ins.opcode not in _FREE and not ins.opcode.endswith("-done")


def _dims(type_text: str) -> list[int] | None:
    m = re.match(r"\(?\s*\w+\[([\d,]*)\]", type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def _reduced_size(ins: Instruction, shapes: dict[str, str]) -> int | None:
    """How many values a reduce adds into each result (None when its operand's shape is not known)."""
    operand = re.match(r"\s*(?:\w+\[[^\]]*\](?:\{[^}]*\})?\s+)?%?([\w.\-$]+)", ins.text)
    axes = re.search(r"dimensions=\{([\d,]*)\}", ins.text)
    dims = _dims(shapes.get(operand.group(1), "")) if operand else None
    if dims is None or axes is None:
        return None
    size = 1
    for axis in (int(a) for a in axes.group(1).split(",") if a):
        size *= dims[axis]
    return size


def low_precision_sums(text: str) -> list[str]:
    """One line per bf16/f16 sum of the optimized HLO `text`: "opcode type (name in computation)"."""
    return [f"{i.opcode} {i.type} ({i.name} in {i.computation})" for i in Program.parse(text).low_precision_sums()]


def kernel_counts(text: str) -> dict[str, int]:
    """{"kernels": in the program, "launches": per call (loop bodies once per trip)} of the optimized HLO."""
    static, launches = Program.parse(text).kernels()
    return {"kernels": static, "launches": launches}
