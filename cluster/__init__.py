"""kvserve on Ray Serve: many replicas behind one gRPC address, routed by held prefix.

    routing.py     pure: routers (round-robin, power-of-two, a score + load guard), PrefixIndex
    replica.py     one engine per Ray Serve replica; reports load and recent block keys
    ray_router.py  Ray Serve RequestRouter running routing.py in the proxy
    ingress.py     kvserve.v1.Generation on Ray Serve's gRPC proxy; dead replica -> UNAVAILABLE
    ray_patches.py every patch of Ray Serve's private modules, each for the pinned Ray
    metrics.py     replica-labelled metrics, router metrics, /targets for Prometheus
    app.py         the application (build_app / app_builder for the YAML config)
    cli.py         ``kvserve cluster serve``

Only ``routing`` is imported by the simulator; everything else needs ``kvserve[ray]``.
"""
