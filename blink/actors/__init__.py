"""Ray placement and lifecycle: Ray places the actors once and restarts them; it never carries a token.

    driver (blink serve --ray | blink deploy)            deploy.py: plan -> placement group -> start()s
      |  placement group `<name>-pg` (placement.py): bundle 0 frontend (+ `dpu` when the cluster
      |  has one), bundle 1+i GPU actor i (+ GPU)
      v
    GpuActor i (gpu_actor.py)            FrontendActor (frontend_actor.py)
      creates ring <ns>-<name>-ring-i      HTTP/SSE ingress (http.py -> blink.dpu.server)
      device process (blink.launch):       Router (router.py): one request tracker per ring,
        CUDA (blink.gpu.serve) or            most free slots wins, dead rings skipped,
        emulated (blink.device.emulated)     replaced rings re-attached
      status() from the ring header        tokenizer / detokenizer / slot tracker / token reader
            \\______________ ring (/dev/shm) ______________/

`config.py` adds the [deploy] section to the serving config; `cli.py` is `blink deploy | status |
stop` and `blink serve --ray`; `raycount.py` counts Ray calls per process (the no-Ray-per-token test).
"""
