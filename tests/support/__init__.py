"""What the tests share: tiny models and GGUF files made here (`factory`, `gguf_writer`), the
reference tokens (`greedy`), faults injected into a real runner (`faults`), a real server in
the test's trio thread (`server_harness`), clients (`grpc_client`, `http_client`), nginx in
front (`nginx_front`), timings of constraint compiles (`compile_timing`), and the client
processes some tests start (`killable`, `hostile_bodies`, `neighbour`, `storm`)."""
