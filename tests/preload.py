"""What the tests' child processes find imported: the fork server they are forked from
(:func:`kvplan.tools.target_process.child_process`) imports this module once, after kvplan's own, so
that each SGLang side of the two-process tests starts in milliseconds instead of importing SGLang
(about four seconds). Where SGLang is absent nothing is imported and its tests skip as before."""

try:
    from tests.sglang_real import sglang_module

    for _name in ("srt.disaggregation.base.conn", "srt.disaggregation.utils", "srt.disaggregation.mooncake.conn",
                  "srt.disaggregation.nixl.conn"):
        sglang_module(_name)
    import kvplan.integrations.sglang.adapter  # noqa: F401
except BaseException:  # noqa: BLE001 - pytest's skip where SGLang is absent; a fork server must not die of it
    pass
