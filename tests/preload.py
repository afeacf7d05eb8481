"""What the tests' child processes find imported: the fork server they are forked from
(:func:`kvplan.tools.target_process.child_process`) imports this module once, after kvplan's own, so
that each SGLang or vLLM side of the two-process tests starts in milliseconds instead of importing
SGLang (about four seconds) or vLLM (about six). vLLM is on the path only in ``make test-vllm``'s
pass, where SGLang must not be imported (the two pin different openai versions); where neither is
installed nothing is imported and their tests skip as before."""

import importlib.util

try:
    if importlib.util.find_spec("vllm") is not None:
        import tests.integrations.vllm_node  # noqa: F401
        import tests.integrations.vllm_scheduler_node  # noqa: F401
    else:
        from tests.sglang_real import sglang_module

        for _name in ("srt.disaggregation.base.conn", "srt.disaggregation.utils", "srt.disaggregation.mooncake.conn",
                      "srt.disaggregation.nixl.conn"):
            sglang_module(_name)
        import kvplan.integrations.sglang.adapter  # noqa: F401
except BaseException:  # noqa: BLE001 - pytest's skip where SGLang is absent; a fork server must not die of it
    pass
