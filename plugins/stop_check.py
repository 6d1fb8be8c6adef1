"""Token-level stop conditions, checked after every appended output token.

Stop *strings* need detokenised text and are handled by the output processor; everything
that can be decided from token ids alone is here so that every scheduler plugin applies the
same rules.
"""

from __future__ import annotations

from tandem.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether `request` is finished after its last appended token.

    Order (as vLLM's `check_stop`): before `min_tokens` outputs only the end of the context
    (`max_model_len` positions) stops the request; then EOS (unless `ignore_eos`), then
    `stop_token_ids`, then the length cap (`max_model_len` positions or `max_tokens`
    outputs). So an EOS or stop token that is also the last allowed token finishes with
    `stop`, not `length`. Sets `status` and, for a stop token, `stop_reason`; returns True
    when finished.
    """
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        if request.num_tokens >= max_model_len:  # no room left for the minimum
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
    last = request.all_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_output(
    request: Request, new_token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append tokens one at a time with a stop check after each; trim after a stop.

    Every returned token resolves one placeholder, including those trimmed at a stop:
    their slots were reserved and computed either way.
    """
    num_returned = len(new_token_ids)
    stopped = False
    for num_kept, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            stopped = True
            # num_computed_tokens covers every kept token but the last one.
            request.num_computed_tokens -= num_returned - num_kept
            del new_token_ids[num_kept:]
            break
    if request.num_output_placeholders > 0:
        request.num_output_placeholders -= num_returned
        assert request.num_output_placeholders >= 0, request.ledger()
    return new_token_ids, stopped
