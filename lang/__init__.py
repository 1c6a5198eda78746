"""radixserve.lang: structured generation programs (gen / select / roles / fork) over a backend.

    from . import function, gen, select, user, assistant, Runtime

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="...", backend=Runtime())
    print(state["answer"])

Constrained gens: gen("n", regex=r"[0-9]{1,3}"), gen("obj", json_schema={...}), and typed gens
gen("age", dtype=int) / gen_int / gen_string, whose value is state.get_typed("age").
"""
from .backend import Backend, BackendError, GenOutput, RequestRecord
from .endpoint import Endpoint
from .ir import assistant, gen, gen_int, gen_string, select, system, user
from .program import SglFunction, function, get_default_backend, set_default_backend
from .runtime import Runtime
from .state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend", "BackendError", "Endpoint", "GenOutput", "ProgramState", "ProgramStateGroup", "RequestRecord",
    "Runtime", "SglFunction", "assistant", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "select", "set_default_backend", "system", "user",
]
