#!/usr/bin/env bash
# Downloads, here, the wheels the GPU machine lacks (it has torch, transformers and httpx, and no network):
# the server (fastapi, uvicorn, pydantic), the openai client, and TRL with datasets for the colocated bench.
# scripts/h200_validate.sh installs whatever lies in .whl/ (git-ignored) before its sections.
set -euo pipefail
cd "$(dirname "$0")/.."
plat=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  plat="$plat --platform ${p}_x86_64"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 uvicorn==0.55.0 openai==3.63.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  opentelemetry-api==1.45.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh .whl
