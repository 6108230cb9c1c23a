// Answers questions about the visibility layer (csrc/common/attention_mask.h) for
// tools/fa2_emulate.py, so the emulator checks its tile ranges, tile classes and mask
// predicate against the header the kernels include instead of a retyped rule.
//
//   g++ -std=c++17 -I csrc tools/mask_probe.cpp -o mask_probe
//   stdin, one query per line (Sq Sk left right are the problem; causal = right 0):
//     keys  Sq Sk left right i0 i1        -> "lo hi"   keys some row of [i0, i1) sees
//     rows  Sq Sk left right j0 j1        -> "lo hi"   rows that see some key of [j0, j1)
//     class Sq Sk left right i0 i1 j0 j1  -> 0 / 1 / 2 (invisible / partial / full)
//     fullkeys Sq Sk left right i0 i1 N   -> "lo hi"   key tiles of N that are full for [i0, i1)
//     fullrows Sq Sk left right j0 j1 M   -> "lo hi"   query tiles of M full for keys [j0, j1)
//     vis   Sq Sk left right i j          -> 0 / 1
//     tile  Sq Sk left right i0 j0 R C    -> "lo hi row_lim key_lim"  the TileBand of a tile
//     tileok Sq Sk left right i0 j0 R C   -> 1 iff TileBand::ok(r, c) == band_visible(i0 + r,
//                                            j0 + c) for every r < R, c < C and the 32-bit
//                                            TileBands gives the same TileBand (else 0)
#include <cstdint>
#include <iostream>
#include <string>

#include "common/attention_mask.h"

int main() {
  std::string op;
  while (std::cin >> op) {
    int64_t Sq, Sk, left, right;
    std::cin >> Sq >> Sk >> left >> right;
    attn_ext::MaskParams m;
    m.left = left;
    m.right = right;
    const attn_ext::Visibility vis{m, Sq, Sk};
    const attn_ext::SeqInfo s = vis.seq(0);
    if (op == "keys" || op == "rows") {
      int64_t a, b;
      std::cin >> a >> b;
      const attn_ext::Range r =
          op == "keys" ? vis.band_keys_of_rows(s, a, b) : vis.band_rows_of_keys(s, a, b);
      std::cout << r.lo << " " << r.hi << "\n";
    } else if (op == "fullkeys" || op == "fullrows") {
      int64_t a, b, n;
      std::cin >> a >> b >> n;
      const attn_ext::Range r =
          op == "fullkeys" ? vis.full_key_tiles(s, a, b, n) : vis.full_row_tiles(s, a, b, n);
      std::cout << r.lo << " " << r.hi << "\n";
    } else if (op == "class") {
      int64_t i0, i1, j0, j1;
      std::cin >> i0 >> i1 >> j0 >> j1;
      std::cout << static_cast<int>(vis.classify(s, i0, i1, j0, j1)) << "\n";
    } else if (op == "tile" || op == "tileok") {
      int64_t i0, j0;
      int R, C;
      std::cin >> i0 >> j0 >> R >> C;
      const attn_ext::TileBand t = vis.tile_band(s, i0, j0, R, C);
      if (op == "tile") {
        std::cout << t.lo << " " << t.hi << " " << t.row_lim << " " << t.key_lim << "\n";
      } else {
        const attn_ext::TileBand t32 =
            vis.tile_bands(s).at(static_cast<int>(i0), static_cast<int>(j0), R, C);
        bool same = t32.lo == t.lo && t32.hi == t.hi && t32.row_lim == t.row_lim &&
                    t32.key_lim == t.key_lim;
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < C; ++c) same &= t.ok(r, c) == vis.band_visible(s, i0 + r, j0 + c);
        }
        std::cout << (same ? 1 : 0) << "\n";
      }
    } else if (op == "vis") {
      int64_t i, j;
      std::cin >> i >> j;
      std::cout << (vis.visible(s, 0, i, j) ? 1 : 0) << "\n";
    } else {
      std::cerr << "mask_probe: unknown query " << op << "\n";
      return 1;
    }
  }
  return 0;
}
