# vllm-mxplus on vLLM's official CUDA image: the plugin plus the CUTLASS prefill extension for
# H100/H200 (sm_90a) and B200 (sm_100a).
#
#   docker build -t vllm-mxplus .
#   docker run --gpus all -p 8000:8000 -e MODEL=/models/my-mxfp4-mbs-ckpt \
#       -v /path/to/models:/models vllm-mxplus
#
# The base tag is pinned (the 0.32 release this plugin is tested against). Its image is built
# on the CUDA *devel* base, so nvcc is present; sm_100a needs CUDA >= 12.8.
FROM vllm/vllm-openai:v0.32.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV TORCH_CUDA_ARCH_LIST="9.0a;10.0a" \
    VLLM_MXPLUS_CUTLASS_EXT=/opt/mxplus/ext/mxplus_cutlass.so \
    MODEL="" \
    PORT=8000 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/mxplus/src
COPY pyproject.toml README.md ./
COPY vllm_mxplus ./vllm_mxplus

# The plugin: the same line as docs/deploy.md (the README's install instructions).
RUN pip install .

# The optional CUTLASS extension, built from the *installed* package (its C++ sources are
# package data; run from / so the source copy above is not on the path): headers from the
# nvidia-cutlass wheel, archs from TORCH_CUDA_ARCH_LIST (`mxplus kernels --build-cutlass`, the
# same step a user runs once on a GPU machine); found via VLLM_MXPLUS_CUTLASS_EXT.
WORKDIR /
RUN pip install nvidia-cutlass==4.2.0.0 \
    && nvcc --version \
    && mxplus kernels --build-cutlass --cutlass-out /opt/mxplus/build --jobs 2 \
    && mkdir -p /opt/mxplus/ext \
    && cp /opt/mxplus/build/mxplus_cutlass*.so "${VLLM_MXPLUS_CUTLASS_EXT}" \
    && rm -rf /opt/mxplus/build

WORKDIR /workspace
EXPOSE 8000

# Serve $MODEL (a checkpoint quantized with `mxplus quantize`, or a bf16 model quantized at
# load) with the paper's default scheme; extra arguments are appended to `vllm serve`.
ENTRYPOINT ["/bin/bash", "-c", "exec vllm serve \"${MODEL:?set MODEL to a model path or id}\" --quantization mxfp4-mbs --port \"${PORT}\" \"$@\"", "--"]
CMD []
