"""Pieces of the side-by-side comparison (``loadtest/compare.py``).

``recording``: the traffic pattern (a deterministic schedule from a seed); ``client``: the
asyncio HTTP/1.1 load generator (open-loop replay, closed-loop throughput); ``haproxy_config``:
the comparison's HAProxy config (exporter output spliced into ``haproxy/haproxy.cfg``);
``paths``: the processes of the four paths; ``analysis``: the ideal fixed window, window
attribution, overshoot and false rejections; ``report``: Markdown tables; ``plot``: the PNG.
"""
