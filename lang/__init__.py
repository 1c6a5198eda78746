"""radixserve.lang: structured generation programs (gen / select / roles / fork) over a backend.

    from radixserve.lang import function, gen, select, user, assistant, Runtime

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="...", backend=Runtime())
    print(state["answer"])
"""
from radixserve.lang.backend import Backend, BackendError, GenOutput, RequestRecord
from radixserve.lang.endpoint import Endpoint
from radixserve.lang.ir import assistant, gen, select, system, user
from radixserve.lang.program import SglFunction, function, get_default_backend, set_default_backend
from radixserve.lang.runtime import Runtime
from radixserve.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend", "BackendError", "Endpoint", "GenOutput", "ProgramState", "ProgramStateGroup", "RequestRecord",
    "Runtime", "SglFunction", "assistant", "function", "gen", "get_default_backend", "select",
    "set_default_backend", "system", "user",
]
