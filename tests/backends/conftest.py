"""tests/backends and its per-backend folders (c/, eager/, triton/): this file puts tests/backends on sys.path
for the folders' tests, which import its shared cases (rotary_cases, triton_interpreter_cases)."""
