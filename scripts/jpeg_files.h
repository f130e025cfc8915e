// The first `count` JPEGs of a folder (sorted by name), read into pinned host memory, for the
// nvJPEG probes (nvjpeg_queues.cu, nvjpeg_formats.cu). Returns false with a message printed when
// the folder cannot be read or holds fewer files.
#pragma once
#include <cuda_runtime.h>
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <algorithm>
#include <string>
#include <vector>

static bool read_jpegs(const char *dir, int count, std::vector<unsigned char *> &data, std::vector<size_t> &lens) {
  std::vector<std::string> files;
  DIR *d = opendir(dir);
  if (!d) { printf("cannot open %s\n", dir); return false; }
  struct dirent *e;
  while ((e = readdir(d))) if (strstr(e->d_name, ".jpg")) files.push_back(std::string(dir) + "/" + e->d_name);
  closedir(d);
  std::sort(files.begin(), files.end());
  if ((int)files.size() < count) { printf("only %zu files\n", files.size()); return false; }
  data.assign(count, nullptr);
  lens.assign(count, 0);
  for (int i = 0; i < count; i++) {
    FILE *f = fopen(files[i].c_str(), "rb");
    if (!f) { printf("cannot open %s\n", files[i].c_str()); return false; }
    fseek(f, 0, SEEK_END); lens[i] = ftell(f); fseek(f, 0, SEEK_SET);
    cudaError_t r = cudaMallocHost((void **)&data[i], lens[i]);
    if (r != cudaSuccess) { printf("cudaMallocHost: %s\n", cudaGetErrorString(r)); fclose(f); return false; }
    bool ok = fread(data[i], 1, lens[i], f) == lens[i];
    fclose(f);
    if (!ok) { printf("cannot read %s\n", files[i].c_str()); return false; }
  }
  return true;
}
