"""Approval rules' conditions: CEL expressions checked when loaded and evaluated with a bound
on their cost (API.md "Approval rules", docs/rules.md).

CEL (https://cel.dev) cannot loop, recurse, define functions or reach the outside world; what
it offers here is narrowed further to a list of functions and variables, checked before an
expression is stored, and every evaluation counts the nodes it visits against a budget and a
clock. The library is cel-python (`celpy`, pure Python): see docs/rules.md for why.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, cast

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import CELEvalError, Evaluator

# The variables an expression may read (docs/rules.md lists their fields).
VARIABLES = frozenset({"input", "tool", "agent", "run"})
# Global functions (`size(x)`, conversions) and methods (`s.startsWith(p)`): CEL's standard
# ones. celpy's own extensions (`reduce`, `min`) are left out: they are not CEL.
FUNCTIONS = frozenset(
    {"size", "int", "uint", "double", "string", "bool", "bytes", "duration", "timestamp",
     "type", "dyn", "has", "matches"}
)  # fmt: skip
METHODS = frozenset(
    {"size", "contains", "startsWith", "endsWith", "matches",
     "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear", "getFullYear", "getMonth",
     "getHours", "getMilliseconds", "getMinutes", "getSeconds"}
)  # fmt: skip
# Comprehension macros: `list.all(x, …)` evaluates its body once per element.
MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})

MAX_EXPRESSION_CHARS = 2000
# A macro inside a macro's body multiplies the work by the size of a list the agent sent.
MAX_MACRO_DEPTH = 1
# What one evaluation may cost: nodes of the syntax tree visited (each element of a macro's
# list visits its body again), and wall time as a second guard.
MAX_COST = 20_000
MAX_SECONDS = 0.05
# The input a rule reads, as JSON: beyond this the call is not read by rules (and every rule
# that would ask for a person counts as matching: docs/rules.md).
MAX_INPUT_BYTES = 64 * 1024


class ConditionError(ValueError):
    """An expression refused when loaded, with where (1-based line and column)."""

    def __init__(self, message: str, *, line: int = 1, column: int = 1) -> None:
        self.message = message
        self.line = line
        self.column = column
        super().__init__(f"line {line}, column {column}: {message}")


class EvaluationError(RuntimeError):
    """An expression that could not be evaluated for one call (a missing field, a type
    mismatch, its cost or time bound reached)."""


@dataclass(frozen=True)
class Condition:
    """A checked expression, ready to evaluate."""

    source: str
    ast: lark.Tree

    def evaluate(self, variables: dict[str, Any]) -> bool:
        """The expression's value for these variables: a bool, or EvaluationError."""
        size = len(json.dumps(variables.get("input"), default=str))
        if size > MAX_INPUT_BYTES:
            raise EvaluationError(f"the input is {size} bytes, over {MAX_INPUT_BYTES}")
        context = {name: celpy.json_to_cel(value) for name, value in variables.items()}
        activation = _ENVIRONMENT.program(self.ast).new_activation()
        evaluator = BoundedEvaluator(self.ast, activation, Budget())
        try:
            value = evaluator.evaluate(context)
        except CELEvalError as error:
            raise EvaluationError(_eval_message(error)) from None
        except (OverBudget, RecursionError) as error:
            raise EvaluationError(str(error) or "too deep") from None
        except (TypeError, ValueError, KeyError, ArithmeticError, AttributeError) as error:
            raise EvaluationError(f"{type(error).__name__}: {error}") from None
        if not isinstance(value, celtypes.BoolType):
            raise EvaluationError(f"the expression gave {type(value).__name__}, not a bool")
        return bool(value)


class OverBudget(Exception):
    pass


class Budget:
    def __init__(self) -> None:
        self.cost = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def spend(self) -> None:
        self.cost += 1
        if self.cost > MAX_COST:
            raise OverBudget(f"the expression costs more than {MAX_COST} steps")
        if self.cost % 256 == 0 and time.monotonic() > self.deadline:
            raise OverBudget(f"the expression took longer than {MAX_SECONDS} s")


class BoundedEvaluator(Evaluator):
    """celpy's interpreter, counting each node it visits (macros' bodies included)."""

    def __init__(self, ast: lark.Tree, activation: Any, budget: Budget) -> None:
        super().__init__(ast, activation)
        self.budget = budget

    def visit(self, tree: lark.Tree) -> Any:
        self.budget.spend()
        return super().visit(tree)

    def sub_evaluator(self, ast: lark.Tree) -> Evaluator:
        return BoundedEvaluator(ast, self.activation, self.budget)


_ENVIRONMENT = celpy.Environment()


def compile_condition(source: str) -> Condition:
    """Parses and checks `source`; ConditionError with the position of the first problem."""
    if not source.strip():
        raise ConditionError("the condition is empty")
    if len(source) > MAX_EXPRESSION_CHARS:
        raise ConditionError(
            f"the condition is {len(source)} characters, over {MAX_EXPRESSION_CHARS}"
        )
    try:
        ast = _ENVIRONMENT.compile(source)
    except celpy.CELParseError as error:
        first = str(error.args[0]).splitlines()[0] if error.args else "syntax error"
        message = "syntax error" if first.strip() == source.strip() else first
        raise ConditionError(message, line=error.line or 1, column=error.column or 1) from None
    except RecursionError:
        raise ConditionError("the condition is nested too deeply") from None
    _check(ast, bound=frozenset(), depth=0)
    return Condition(source=source, ast=ast)


def _position(node: lark.Tree | lark.Token) -> tuple[int, int]:
    if isinstance(node, lark.Token):
        return node.line or 1, node.column or 1
    for token in node.scan_values(lambda value: isinstance(value, lark.Token)):
        return token.line or 1, token.column or 1
    return 1, 1


def _refuse(message: str, node: lark.Tree | lark.Token) -> ConditionError:
    line, column = _position(node)
    return ConditionError(message, line=line, column=column)


def _check(node: lark.Tree, *, bound: frozenset[str], depth: int) -> None:
    """Every name a variable (or a macro's), every call a function or method offered."""
    data = node.data
    if data == "ident":
        token = cast(lark.Token, node.children[0])
        if token.value not in VARIABLES and token.value not in bound:
            raise _refuse(
                f"unknown name {token.value!r}: the variables are " + ", ".join(sorted(VARIABLES)),
                token,
            )
        return
    if data in ("ident_arg", "dot_ident_arg"):
        token = cast(lark.Token, node.children[0])
        if token.value not in FUNCTIONS:
            raise _refuse(f"no function {token.value!r} in rules' CEL", token)
    elif data in ("dot_ident",):
        raise _refuse("names from a package are not available", node)
    elif data == "member_object":
        raise _refuse("messages cannot be built in a condition", node)
    elif data == "member_dot_arg":
        target, name = node.children[0], cast(lark.Token, node.children[1])
        if name.value in MACROS:
            if depth >= MAX_MACRO_DEPTH:
                raise _refuse(
                    f"{name.value}() inside another macro: at most {MAX_MACRO_DEPTH} level",
                    name,
                )
            arguments = node.children[2] if len(node.children) > 2 else None
            expressions = list(arguments.children) if isinstance(arguments, lark.Tree) else []
            if len(expressions) != 2:
                raise _refuse(f"{name.value}() takes a variable and an expression", name)
            variable = _macro_variable(expressions[0])
            if variable is None:
                raise _refuse(f"{name.value}()'s first argument must be a name", name)
            _check(cast(lark.Tree, target), bound=bound, depth=depth)
            _check(expressions[1], bound=bound | {variable}, depth=depth + 1)
            return
        _check(cast(lark.Tree, target), bound=bound, depth=depth)
        if name.value not in METHODS:
            raise _refuse(f"no method {name.value!r} in rules' CEL", name)
    for child in node.children:
        if isinstance(child, lark.Tree):
            _check(child, bound=bound, depth=depth)


def _macro_variable(expression: lark.Tree) -> str | None:
    """The name a macro binds (`x` in `list.all(x, …)`): an expression that is one ident."""
    idents = list(expression.find_data("ident"))
    tokens = list(expression.scan_values(lambda value: isinstance(value, lark.Token)))
    if len(idents) == 1 and len(tokens) == 1:
        return str(tokens[0].value)
    return None


def _eval_message(error: CELEvalError) -> str:
    text = str(error.args[0]) if error.args else "evaluation error"
    # celpy names the whole activation in some messages: keep the first clause.
    return text.split(" (in activation", 1)[0][:300]
