// The parameter server's cost model: workers' round trips to the servers, sparse rows, the servers' load.
#include <torchpar/plan/cost_terms.h>
#include <torchpar/ps/wire_format.h>

namespace torchpar::plan {

using namespace terms;

namespace {

// What a server's part of a sparse table (`bytes` of rows once every row was touched) and the optimizer's `state`
// per value byte peak at: a row exists once touched and the storage grows by doubling (ps/sparse_table.cpp), to a
// capacity of the rows rounded up to a power of two (exact where a row's bytes are one), its tensors one after the
// other: as the last grows, the others are grown already and it holds its old half beside its new whole.
double grown_rows_peak(double bytes, double state) {
  if (bytes <= 0) return 0.0;
  double capacity = 1;
  while (capacity < bytes) capacity *= 2;
  return capacity * (1 + state + 0.5);
}

} // namespace

Prediction predict_parameter_server(const ModelProfile& model, const NetworkProfile& idle_network,
                                    const TrainingSetup& setup, const Configuration& configuration,
                                    const Calibration& given) {
  const int servers = configuration.servers;
  const int workers = configuration.world - servers;
  const auto calibration = with_contention(model, given, workers, configuration.world);
  const auto network = under_load(idle_network, given);
  TORCH_CHECK(servers >= 1 && workers >= 1, configuration.world, " ranks cannot hold ", servers,
              " server(s) and at least one worker");
  check_divides(setup.batch, workers, "workers");
  const int64_t samples = setup.batch / workers;
  // Embedding tables live on the servers as sparse rows: a worker holds, pulls and pushes only the rows
  // its samples touch, and its backward makes gradients for those rows alone (the dense layers as before).
  ModelProfile dense = model;
  double sparse_table = 0, touched = 0;
  for (auto& layer : dense.layers) {
    if (layer.sparse_parameter_bytes <= 0) continue;
    const double rows = std::min<double>(static_cast<double>(layer.sparse_parameter_bytes),
                                         static_cast<double>(samples * layer.sparse_bytes_per_sample));
    const double kept = static_cast<double>(layer.parameter_bytes - layer.sparse_parameter_bytes) + rows;
    const double share_of_gradient = layer.parameter_bytes > 0 ? kept / static_cast<double>(layer.parameter_bytes) : 0;
    layer.backward_weight_ms *= share_of_gradient;
    layer.backward_weight_overhead_ms *= share_of_gradient;
    layer.parameter_bytes -= layer.sparse_parameter_bytes;
    sparse_table += static_cast<double>(layer.sparse_parameter_bytes);
    touched += rows;
  }
  const auto parameters = static_cast<double>(dense.parameter_bytes());
  // Payloads larger than a frame's between ranks of one host go through the channel's ring, behind a
  // fixed-size frame that still goes through Gloo, with a copy in and a copy out.
  const auto through_ring = [&](double bytes) {
    return bytes > static_cast<double>(ps::Frame::kInlineBytes) && bytes <= static_cast<double>(network.ps_ring_bytes);
  };
  const auto transfer_ms = [&](double bytes) {
    return through_ring(bytes) ? network.send_recv.milliseconds(static_cast<double>(ps::Frame::kBytes)) +
                                     2 * network.copy.ms_per_byte * bytes
                               : network.send_recv.milliseconds(bytes);
  };
  // A server's receive of `bytes` and its answer of as many.
  const auto both_ways_ms = [&](double bytes) {
    return through_ring(bytes) ? 2 * transfer_ms(bytes) : network.send_recv.milliseconds(2 * bytes);
  };
  // A bucket's round trip: the worker copies its gradients into the push, each server (answering its
  // part in parallel with the others) applies the optimizer to it and copies its values into the
  // reply, which the worker copies into its parameters. Under BSP the server applies a bucket once every
  // worker pushed it, receiving and copying the pushes one after the other, so a worker's answer waits for
  // the others' pushes too (the workers, symmetric, push at once); under ASP its push is applied as it arrives
  // (measured on 2 workers: ASP 1.16x faster, where both were predicted alike).
  const double others = configuration.synchronous ? workers - 1 : 0;
  const auto round_trip_ms = [&](double bytes) {
    const double part = bytes / servers;
    return 2 * transfer_ms(part) + network.copy.ms_per_byte * (2 * bytes + part) +
           others * (transfer_ms(part) + network.copy.ms_per_byte * part) +
           optimizer_ms(model, setup, part, workers, configuration.world) + calibration.ps_ms_per_byte * bytes;
  };
  const auto step = overlapped_step(dense, samples, {static_cast<size_t>(configuration.bucket_bytes)}, calibration,
                                    0.0, round_trip_ms);
  // The touched rows: pulled before forward, their gradients pushed (and applied) after backward.
  const double rows_ms = touched > 0 ? 2 * round_trip_ms(touched) + calibration.ps_rows_ms : 0.0;
  // Each server receives every worker's push of its share and answers every pull, and applies the
  // optimizer to its share once per step (synchronous) or per push (asynchronous); and the same for the
  // rows each worker touched.
  const double share = parameters / servers;
  const double rows_share = touched / servers;
  const double server_ms =
      workers * (both_ways_ms(share) + both_ways_ms(rows_share) +
                 (network.copy.ms_per_byte + calibration.ps_ms_per_byte) * (share + rows_share)) +
      optimizer_ms(model, setup, share * (configuration.synchronous ? 1 : workers) + rows_share * workers, workers,
                   configuration.world);
  const double worker_ms = step.forward_ms + step.finish_ms + rows_ms;
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = step.forward_ms + step.backward_ms;
  prediction.step_ms = std::max(worker_ms, server_ms) + calibration.per_step_ms + calibration.ps_per_step_ms;
  prediction.exposed_comm_ms = prediction.step_ms - prediction.compute_ms;
  // Measured per rank (docs/planner.md): a worker holds its parameters, their gradients and one copy of the values
  // the servers answered (the first pull's), the rows it touched (rows, gradients, the reply), and maps the pages
  // of the values the servers lend it. A server holds the optimizer's state of its share; its values in a
  // shared region its workers read (between ranks of one host; elsewhere a tensor of its own); under BSP each
  // worker's push twice until the round is applied (the round's copy, and the message deferred until its pull can
  // be answered); under ASP a push applied from the ring where it arrived (else from its own copy); Adam's
  // temporaries; its part of the sparse tables with their state (sparse rows take plain SGD unless the model
  // trains with Adam), once a long training touched every row, and the pushes of rows. Between ranks of one host
  // both ends also map the pages of both rings of each channel that the payloads in flight touched (every bucket at
  // once, at most the ring).
  const bool same_host = network.ps_ring_bytes > 0;
  const auto channel_pages = [&](double bytes) { return through_ring(bytes) ? 2 * bytes : 0.0; };
  MemoryBreakdown worker;
  worker.add("parameters", parameters);
  worker.add("gradients", parameters);
  worker.add("the servers' values, as first pulled", parameters);
  if (same_host) worker.add("the servers' values lent (their pages mapped)", parameters, false);
  worker.add("sparse rows touched (rows, gradients, reply)", 3 * touched);
  worker.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
  worker.add("parameter server rings' pages", servers * channel_pages((parameters + touched) / servers), false);
  worker.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  add_host_lines(worker, network.host_memory, heap_retained(model, parameters));
  const double rows_state = setup.optimizer_state_factor >= 2 ? setup.optimizer_state_factor : 0.0;
  MemoryBreakdown server;
  server.add("its share of the parameters (shared with its workers)", share, !same_host);
  server.add("optimizer state", share * setup.optimizer_state_factor);
  if (configuration.synchronous) {
    server.add("workers' pushes, twice until the round is applied", 2 * workers * share);
  } else if (!through_ring(share)) {
    server.add("workers' pushes, as received", workers * share);
  }
  if (setup.optimizer_state_factor >= 2) server.add("Adam's temporaries", 2 * share);
  server.add("its part of the sparse tables with their state, as they grow",
             grown_rows_peak(sparse_table / servers, rows_state));
  server.add("workers' pushes of sparse rows", 2 * workers * rows_share);
  server.add("parameter server rings' pages", workers * channel_pages(share + rows_share), false);
  add_host_lines(server, network.host_memory, 0.0);  // it runs no training loop
  prediction.memory = worker.total() >= server.total() ? std::move(worker) : std::move(server);
  settle_memory(prediction);
  prediction.bytes_per_step = static_cast<int64_t>(std::max(2 * (parameters + touched),
                                                            2 * (share + rows_share) * workers));
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

} // namespace torchpar::plan
