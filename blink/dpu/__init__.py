"""Frontend ("DPU") roles, one module per role; they reach the device only through the ring.

tokenizer.py (encode, chat template, validation), detokenizer.py (incremental text, stop strings),
slot_tracker.py (free slots, publishing requests), token_reader.py (tokens back, device health),
request_tracker.py (per-request state joining the two); the HTTP server: server.py (the app and its
small endpoints), completions.py (the generation endpoints, JSON or SSE), middleware.py (browser
safety, API key, errors in OpenAI's shape), openai_api.py (request bodies, validated),
openai_responses.py and openai_logprobs.py (response objects).
Nothing here imports cupy: these roles are meant to run on a DPU's ARM cores.
"""
