{
  "targets": [
    {
      "target_name": "layerwise_native",
      "sources": ["src/addon.cc", "src/matmul.cc", "src/adamw.cc", "src/elementwise.cc", "src/attention.cc", "src/conv.cc", "src/conv_addon.cc", "src/bf16.cc", "src/affinity.cc"],
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")"],
      "defines": ["NAPI_VERSION=8", "NAPI_CPP_EXCEPTIONS"],
      "cflags!": ["-fno-exceptions"],
      "cflags_cc!": ["-fno-exceptions"],
      "cflags_cc": ["-std=c++17", "-O3", "-march=native", "-fopenmp", "-fexceptions", "-fno-math-errno"],
      "libraries": ["-ldnnl", "-fopenmp"],
      "ldflags": ["-Wl,-z,nodelete"]
    }
  ]
}
