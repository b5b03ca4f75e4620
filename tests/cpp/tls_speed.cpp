// rumor_tls_speed: what TLS costs one core (issue 46's target: >= 2 GB/s per core). A client and a
// server TlsSession in ONE thread, wired back to back through their memory BIOs: the client seals
// --mib MiB in --record-byte writes (one record each), the server opens them, and memcpy copies the
// same bytes, batch by batch, alternating. Beside them, the suite's AEAD alone through EVP on the
// same records: the bound the session's own copies and framing are measured against.
//
//   rumor_tls_speed [--mib 256] [--record 16384] [--batch-kib 256] [--repeats 5] [--suite NAME]
//
// Prints one JSON object on stdout: per suite and repeat GB/s of plaintext by wall clock and by
// the thread's CPU time (the machine is shared), medians, and ratios to memcpy. No socket is
// involved; benchmarks/tls_cipher.py runs it and draws the table and plot.
#include <openssl/evp.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "net/tls.h"

namespace {

using rumor::net::TlsRole;
using rumor::net::TlsSession;

struct Clocks {
  double wall = 0, cpu = 0;
};
Clocks now() {
  timespec w{}, c{};
  clock_gettime(CLOCK_MONOTONIC, &w);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c);
  return {w.tv_sec + w.tv_nsec * 1e-9, c.tv_sec + c.tv_nsec * 1e-9};
}
Clocks operator-(Clocks a, Clocks b) { return {a.wall - b.wall, a.cpu - b.cpu}; }
Clocks& operator+=(Clocks& a, Clocks b) {
  a.wall += b.wall;
  a.cpu += b.cpu;
  return a;
}

void move_out(TlsSession& from, TlsSession& to) {
  std::span<const uint8_t> out = from.peek_out();
  to.feed(out);
  from.consume_out(out.size());
}

// The suite's AEAD on its own: every record sealed under a fresh nonce with its 16-byte tag.
double aead_seconds_cpu(const std::string& suite, const std::vector<uint8_t>& plain, size_t record,
                        std::vector<uint8_t>& sealed) {
  const EVP_CIPHER* cipher = suite == "TLS_AES_128_GCM_SHA256"   ? EVP_aes_128_gcm()
                             : suite == "TLS_AES_256_GCM_SHA384" ? EVP_aes_256_gcm()
                                                                 : EVP_chacha20_poly1305();
  unsigned char key[32] = {1}, iv[12] = {2}, tag[16];
  std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)> ctx(EVP_CIPHER_CTX_new(),
                                                                      &EVP_CIPHER_CTX_free);
  EVP_EncryptInit_ex(ctx.get(), cipher, nullptr, key, nullptr);
  const Clocks t0 = now();
  for (size_t off = 0; off < plain.size(); off += record) {
    const int n = static_cast<int>(std::min(record, plain.size() - off));
    int len = 0;
    iv[0] = static_cast<unsigned char>(off / record);
    EVP_EncryptInit_ex(ctx.get(), nullptr, nullptr, nullptr, iv);
    EVP_EncryptUpdate(ctx.get(), sealed.data() + off, &len, plain.data() + off, n);
    EVP_EncryptFinal_ex(ctx.get(), sealed.data() + off + len, &len);
    EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_AEAD_GET_TAG, sizeof(tag), tag);
  }
  return (now() - t0).cpu;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
}

std::string list(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

struct Args {
  size_t mib = 256, record = 16384, batch_kib = 256;
  int repeats = 5;
  std::vector<std::string> suites;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--mib")
      a.mib = std::stoul(v);
    else if (k == "--record")
      a.record = std::stoul(v);
    else if (k == "--batch-kib")
      a.batch_kib = std::stoul(v);
    else if (k == "--repeats")
      a.repeats = std::stoi(v);
    else if (k == "--suite")
      a.suites.push_back(v);
    else
      throw std::runtime_error("unknown option " + k);
  }
  if (a.suites.empty())
    a.suites = {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"};
  if (a.record == 0 || a.record > 16384 || a.batch_kib == 0 || a.mib * 1024 < a.batch_kib || a.repeats < 1)
    throw std::runtime_error("need 0 < --record <= 16384, 0 < --batch-kib <= --mib * 1024, --repeats >= 1");
  return a;
}

std::string run_suite(const Args& a, const std::string& suite, const rumor::net::PemCredentials& ca,
                      const rumor::net::PemCredentials& server_cred,
                      const rumor::net::PemCredentials& client_cred) {
  auto ctx = [&](const rumor::net::PemCredentials& me) {
    rumor::net::TlsConfig c;
    c.cert_pem = me.cert_pem;
    c.key_pem = me.key_pem;
    c.ca_pem = ca.cert_pem;
    c.suites = suite;
    return std::make_shared<const rumor::net::TlsContext>(c);
  };
  TlsSession client(ctx(client_cred), TlsRole::kClient, "speed client");
  TlsSession server(ctx(server_cred), TlsRole::kServer, "speed server");
  for (int i = 0; i < 10 && !(client.handshake_done() && server.handshake_done()); ++i) {
    client.handshake_step();
    move_out(client, server);
    server.handshake_step();
    move_out(server, client);
  }
  if (!client.handshake_done() || !server.handshake_done())
    throw std::runtime_error("handshake did not finish");
  if (server.suite() != suite) throw std::runtime_error("negotiated " + server.suite() + ", not " + suite);

  const size_t batch = a.batch_kib << 10, batches = (a.mib << 10) / a.batch_kib;
  std::vector<uint8_t> plain(batch), opened(batch), copy(batch), sealed(batch + 16 * (batch / a.record + 1));
  std::mt19937_64 g(1);
  for (size_t i = 0; i < batch; i += 8) {
    const uint64_t x = g();
    std::memcpy(&plain[i], &x, std::min<size_t>(8, batch - i));
  }
  std::vector<double> seal_w, seal_c, open_w, open_c, copy_w, copy_c, aead_c;
  for (int r = 0; r <= a.repeats; ++r) {  // repeat 0 warms up
    Clocks seal, open, cp;
    double aead = 0;
    for (size_t b = 0; b < batches; ++b) {
      Clocks t0 = now();
      for (size_t off = 0; off < batch; off += a.record)
        client.write(std::span<const uint8_t>(plain).subspan(off, std::min(a.record, batch - off)));
      std::span<const uint8_t> ct = client.peek_out();
      Clocks t1 = now();
      server.feed(ct);
      client.consume_out(ct.size());
      size_t got = 0;
      while (got < batch) {
        const size_t n = server.read(std::span<uint8_t>(opened).subspan(got));
        if (n == 0) throw std::runtime_error("server read returned nothing before the batch's end");
        got += n;
      }
      Clocks t2 = now();
      std::memcpy(copy.data(), plain.data(), batch);
      Clocks t3 = now();
      seal += t1 - t0;
      open += t2 - t1;
      cp += t3 - t2;
      aead += aead_seconds_cpu(suite, plain, a.record, sealed);
      if (b == 0 &&
          (std::memcmp(opened.data(), plain.data(), batch) != 0 || copy[batch / 2] != plain[batch / 2]))
        throw std::runtime_error("opened bytes differ from the sealed ones");
    }
    if (r == 0) continue;
    const double bytes = static_cast<double>(batch * batches);
    seal_w.push_back(bytes / seal.wall / 1e9);
    seal_c.push_back(bytes / seal.cpu / 1e9);
    open_w.push_back(bytes / open.wall / 1e9);
    open_c.push_back(bytes / open.cpu / 1e9);
    copy_w.push_back(bytes / cp.wall / 1e9);
    copy_c.push_back(bytes / cp.cpu / 1e9);
    aead_c.push_back(bytes / aead / 1e9);
  }
  const double mc = median(copy_c), mw = median(copy_w);
  std::string s = "{\"suite\": \"" + suite + "\"";
  s += ", \"encrypt_gbs\": " + list(seal_w) + ", \"encrypt_cpu_gbs\": " + list(seal_c);
  s += ", \"decrypt_gbs\": " + list(open_w) + ", \"decrypt_cpu_gbs\": " + list(open_c);
  s += ", \"memcpy_gbs\": " + list(copy_w) + ", \"memcpy_cpu_gbs\": " + list(copy_c);
  s += ", \"aead_only_cpu_gbs\": " + list(aead_c);
  auto field = [](const char* name, double v) {
    return std::string("\"") + name + "\": " + std::to_string(v);
  };
  s += ", \"median\": {" + field("encrypt_gbs", median(seal_w)) + ", " +
       field("encrypt_cpu_gbs", median(seal_c)) + ", " + field("decrypt_gbs", median(open_w)) + ", " +
       field("decrypt_cpu_gbs", median(open_c)) + ", " + field("memcpy_gbs", mw) + ", " +
       field("memcpy_cpu_gbs", mc) + ", " + field("aead_only_cpu_gbs", median(aead_c)) + "}";
  s += ", \"ratio_to_memcpy\": {" + field("encrypt_cpu", median(seal_c) / mc) + ", " +
       field("decrypt_cpu", median(open_c) / mc) + ", " + field("encrypt", median(seal_w) / mw) + ", " +
       field("decrypt", median(open_w) / mw) + "}}";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    const auto t0 = std::chrono::system_clock::now() - std::chrono::hours(1);
    const auto t1 = t0 + std::chrono::hours(48);
    const auto ca = rumor::net::make_ca("speed ca", t0, t1);
    const auto sc = rumor::net::issue_certificate(ca, "server", {"server"}, t0, t1);
    const auto cc = rumor::net::issue_certificate(ca, "client", {"client"}, t0, t1);
    std::string out =
        "{\"mib\": " + std::to_string(a.mib) + ", \"record_bytes\": " + std::to_string(a.record) +
        ", \"batch_kib\": " + std::to_string(a.batch_kib) + ", \"repeats\": " + std::to_string(a.repeats) +
        ", \"openssl\": \"" + OpenSSL_version(OPENSSL_VERSION) + "\", \"suites\": [";
    for (size_t i = 0; i < a.suites.size(); ++i)
      out += (i ? ", " : "") + run_suite(a, a.suites[i], ca, sc, cc);
    std::printf("%s]}\n", out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rumor_tls_speed: %s\n", e.what());
    return 1;
  }
}
